"""On a CUDA host only (issue #22): the worker's launch plan runs each slot on the GPU that the
worker's own CUDA_VISIBLE_DEVICES names, checked against `nvidia-smi`'s UUIDs.

The worker's list is the host's GPUs in reverse order, by index and by UUID, so on a host of two
or more GPUs slot 0 must land on the last one, not on GPU 0. The plan is carried out as the
worker does (`build_launch`, its folders, its command line and environment), and the rank
names its GPU in its log (`placement:`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.workers.runtime.conftest import free_port
from workers.launcher.command import NodeLaunch, build_launch
from workers.launcher.devices import slot_ids
from workers.launcher.run_dir import lay_out_run_dir

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
    reason="needs a CUDA GPU and nvidia-smi (bash .ci/gpu)",
)


def host_gpus() -> list[tuple[str, str]]:
    """(index, UUID) of every GPU, as nvidia-smi reports them."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return [(index.strip(), uuid.strip()) for index, uuid in rows]


def launch_for(run_dir: Path, worker_list: str | None = None, slots: int = 1) -> NodeLaunch:
    """A one-epoch single job on slot 0 of a worker whose CUDA_VISIBLE_DEVICES is
    `worker_list`; None: a CPU worker."""
    cuda = worker_list is not None
    return NodeLaunch(
        job_id=1, attempt=1, node_rank=0, nnodes=1, mode="single", gpus=(0,),
        accelerator="cuda" if cuda else "cpu", master_addr="127.0.0.1", master_port=free_port(),
        entrypoint={"kind": "builtin", "model": "cnn", "dataset": "synthetic"},
        hyperparameters={"epochs": 1, "batch_size": 32, "num_workers": 0, "synthetic_size": 256},
        script_path=None, run_dir=run_dir, python=sys.executable,
        device_ids=slot_ids(worker_list, slots)[:1] if cuda else (),
        base_env={"PYTHONPATH": str(REPO)},  # the worker's installed package, here the checkout
    )  # fmt: skip


def run_plan(launch: NodeLaunch) -> str:
    """The plan carried out as the worker's supervisor does, unsandboxed (its run folder laid
    out by the same function); the rank's log."""
    plan = build_launch(launch)
    lay_out_run_dir(plan)
    proc = subprocess.run(plan.argv, env=plan.env, cwd=plan.cwd, capture_output=True, text=True, timeout=240)
    logs = "".join(p.read_text() for p in sorted(plan.paths.logs.glob("*/attempt_*/0/*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs[-3000:]}"
    return logs


@pytest.mark.parametrize("form", ["index", "uuid"])
def test_slot_0_runs_on_the_first_gpu_of_the_workers_own_list(form: str, tmp_path: Path) -> None:
    gpus = list(reversed(host_gpus()))
    worker_list = ",".join(index if form == "index" else uuid for index, uuid in gpus)
    launch = launch_for(tmp_path / "run", worker_list, len(gpus))
    expected_uuid = gpus[0][1]
    assert build_launch(launch).env["CUDA_VISIBLE_DEVICES"] == worker_list.split(",")[0]
    log = run_plan(launch)
    (line,) = re.findall(r"\] placement: (.*)", log)
    assert line.startswith("cuda:0 (") and expected_uuid in line, (line, expected_uuid)
