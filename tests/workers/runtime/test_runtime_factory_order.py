"""Factories run on each node's local rank 0 before the node's other ranks (they may download
or cache into a place the node's ranks share), under real torchrun with 2 DDP ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORDING_FACTORY = """
import json
import os
import time
from pathlib import Path

from workers.runtime.trainer.data import builtin_datasets
from workers.runtime.trainer.models import build_mlp

def _record(role):
    folder = Path(os.environ["FACTORY_MARKERS"])
    rank = os.environ["LOCAL_RANK"]
    started = time.time()
    seen = sorted(p.name for p in folder.iterdir())  # what the cache holds when this rank comes
    if rank == "0":
        time.sleep(1.5)  # a download: long enough that a rank arriving at once would not wait for it
    record = {"started": started, "seen": seen, "ended": time.time()}
    (folder / f"{role}-{rank}").write_text(json.dumps(record))

def model():
    _record("model")
    return build_mlp()

def data():
    _record("data")
    return builtin_datasets("synthetic", synthetic_size=256)
"""


def test_a_factory_runs_on_local_rank_zero_before_the_nodes_other_ranks(jobs: Any, tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "recording.py").write_text(RECORDING_FACTORY)
    markers = tmp_path / "markers"
    markers.mkdir()
    config = jobs.config("ddp", epochs=1)
    config["entrypoint"] = {"kind": "factory", "model": "recording:model", "dataset": "recording:data"}
    jobs.start(
        tmp_path / "run", config, nproc=2, PYTHONPATH=str(tmp_path / "pkg"), FACTORY_MARKERS=str(markers)
    ).ok()
    for role in ("model", "data"):
        leader = json.loads((markers / f"{role}-0").read_text())
        other = json.loads((markers / f"{role}-1").read_text())
        assert f"{role}-0" in other["seen"], (role, other)  # rank 0 had finished when rank 1 began
        assert other["started"] >= leader["ended"]
        assert f"{role}-1" not in leader["seen"]
