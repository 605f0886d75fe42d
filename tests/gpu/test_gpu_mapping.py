"""On a CUDA host only (issues #22, #37): a worker's slot runs on the GPU that the worker's own
CUDA_VISIBLE_DEVICES names, checked against `nvidia-smi`'s UUIDs, inside the worker's sandbox.

The worker's list is the host's GPUs in reverse order, by index and by UUID, so on a host of two
or more GPUs slot 0 must land on the last one, not on GPU 0. The sandbox binds only that card's
device file, and CUDA numbers what it finds from 0: the rank is told its card by UUID, whatever
form the worker was given, and names it in its log (`placement:`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.workers.launcher.worker_node import (
    NodeSpec,
    assert_succeeded,
    launch_of,
    run_node,
    worker_isolation,
)
from workers.launcher import devices
from workers.launcher.command import build_launch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
    reason="needs a CUDA GPU and nvidia-smi (bash .ci/gpu)",
)
ONE_EPOCH = {"epochs": 1, "batch_size": 32, "num_workers": 0, "synthetic_size": 256}


@pytest.mark.parametrize("form", ["index", "uuid"])
def test_slot_0_runs_on_the_first_gpu_of_the_workers_own_list(form: str, tmp_path: Path) -> None:
    gpus = list(reversed(devices.nvidia_gpus()))
    assert gpus, "nvidia-smi lists no GPU"
    worker_list = tuple(str(g.index) if form == "index" else g.uuid for g in gpus)
    spec = NodeSpec(slots=(0,), worker_gpus=worker_list, hyperparameters=ONE_EPOCH)
    expected = gpus[0]
    plan = build_launch(launch_of(tmp_path / "plan", spec, worker_isolation()))
    assert plan.env["CUDA_VISIBLE_DEVICES"] == expected.uuid  # by UUID, whatever the worker's form
    record = run_node(tmp_path / "run", spec)
    assert_succeeded(record)
    (line,) = record.placements()
    assert line.startswith("cuda:0 (") and expected.uuid in line, (line, expected)
