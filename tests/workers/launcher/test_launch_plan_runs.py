"""A launch plan carried out as the worker carries it out, on the CPU, with the harness the GPU
suite launches through (tests/workers/launcher/worker_node.py): a CPU worker's rank is told no
CUDA device, and says where it computes in the `placement:` line the GPU tests read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.workers.launcher.worker_node import (
    NodeSpec,
    assert_succeeded,
    launch_of,
    run_node,
    worker_isolation,
)
from workers.launcher.command import build_launch

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the worker's sandbox as a root worker builds it")


def test_a_cpu_plan_runs_and_its_rank_says_where_it_computes(tmp_path: Path) -> None:
    spec = NodeSpec(hyperparameters={"epochs": 1, "batch_size": 32, "num_workers": 0, "synthetic_size": 256})
    plan = build_launch(launch_of(tmp_path / "plan", spec, worker_isolation()))
    assert plan.env["CUDA_VISIBLE_DEVICES"] == ""
    record = run_node(tmp_path / "run", spec)
    assert_succeeded(record)
    assert record.placements() == ["cpu, backend none (one process)"]
    assert list(record.checkpoints) == ["epoch-0001.pt"]
