"""``python -m megatron_kd.train``: the same entry point as ``megatron-kd train`` (``commands/train.py``)."""

import sys

from megatron_kd.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
