"""Writes what a script sees of its own start-up to PROBE_DIR/rank-RANK.json."""

import json
import os
import sys
import threading
from pathlib import Path

import torch.distributed as dist

seen = {
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "rank": os.environ.get("RANK"),
    "default_group": dist.is_initialized(),
    "threads": threading.active_count(),
}
Path(os.environ["PROBE_DIR"], f"rank-{os.environ['RANK']}.json").write_text(json.dumps(seen))
