"""A launch plan carried out as the worker carries it out (folders, command line, environment),
on the CPU: the harness that tests/gpu/test_gpu_mapping.py runs on a GPU host, shown to work
here, and the rank's `placement:` line that the GPU test reads."""

from __future__ import annotations

import re
from pathlib import Path

from tests.gpu.test_gpu_mapping import launch_for, run_plan
from workers.launcher.command import build_launch


def test_a_cpu_plan_runs_and_its_rank_says_where_it_computes(tmp_path: Path) -> None:
    launch = launch_for(tmp_path / "run")
    assert build_launch(launch).env["CUDA_VISIBLE_DEVICES"] == ""
    log = run_plan(launch)
    assert re.findall(r"\] placement: (.*)", log) == ["cpu, backend none (one process)"]
    assert (tmp_path / "run" / "checkpoints" / "epoch-0001.pt").exists()
