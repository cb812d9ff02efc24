"""megatron-bridge and the packages its import reads are installed apart (``launch/setup.sh``: the
environment's ``bridge`` folder), so that no other test process imports them; these tests put that
folder on the path, after the environment's own packages."""

import sys
from pathlib import Path

BRIDGE_SITE = Path(sys.prefix) / "bridge"
if BRIDGE_SITE.is_dir() and str(BRIDGE_SITE) not in sys.path:
    sys.path.append(str(BRIDGE_SITE))
