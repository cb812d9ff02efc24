"""``python -m megatron_kd.bridge``: see ``cli.py``."""

import sys

from megatron_kd.bridge.cli import main

if __name__ == "__main__":
    sys.exit(main())
