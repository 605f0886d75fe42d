"""On a CUDA host only (issue #37): jobs launched as a worker launches them, through its real
sandbox (tests/workers/launcher/worker_node.py: the worker's isolation probe, its device
files, CUDA_VISIBLE_DEVICES by UUID, `build_launch`, the real supervisor). The CPU twin of the
harness runs in the normal suite (tests/workers/launcher/test_worker_node.py).

What the audit found that only a GPU shows: a rank on the host's *last* GPU (the sandbox binds
only that card, and CUDA numbers what it finds from 0), amp with accumulation and clipping
under DDP, `compile`, SIGTERM preemption over NCCL resumed at another world size, two nodes
of one job from two workers on one host, loader workers with pinned memory, a script job. (The
synchronised BatchNorm of DataParallel, in fp16 and bf16 too, is in test_gpu_training.py.)
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.workers.launcher.worker_node import (
    NodeRecord,
    NodeSpec,
    assert_succeeded,
    run_node,
    run_nodes,
    script,
)
from tests.workers.runtime.conftest import free_port
from workers.launcher import devices

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
    reason="needs a CUDA GPU and nvidia-smi (bash .ci/gpu)",
)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
HYPER = {"epochs": 2, "batch_size": 64, "num_workers": 0, "synthetic_size": 2048, "report_every": 4}


def worker_gpus() -> tuple[str, ...]:
    """The worker's own GPU list, as a worker started here reads it (its CUDA_VISIBLE_DEVICES,
    else every GPU of the host)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len(devices.nvidia_gpus()) if not visible else len(visible.split(","))
    return devices.slot_ids(visible, count)


def uuid_of(device_id: str) -> str:
    found = [g for g in devices.nvidia_gpus() if str(g.index) == device_id or g.uuid.startswith(device_id)]
    assert len(found) == 1, (device_id, devices.nvidia_gpus())
    return found[0].uuid


def learned(record: NodeRecord) -> bool:
    losses = [e["loss"] for e in record.progress() if "loss" in e]
    return len(losses) >= 4 and sum(losses[-2:]) < sum(losses[:2])


SEES = """
import os, subprocess, torch
print("initialised", torch.cuda.is_initialized(), flush=True)  # the in-launch pre-flight ran apart
print("count", torch.cuda.device_count(), flush=True)
print("visible", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout, flush=True)
x = torch.ones(1024, device="cuda")
print("sum", float(x.sum()), flush=True)
"""


def test_a_script_job_on_the_hosts_last_gpu_sees_that_card_and_no_other(tmp_path: Path) -> None:
    gpus = worker_gpus()
    last = len(gpus) - 1
    probe = script(tmp_path, "sees.py", SEES)
    spec = NodeSpec(
        slots=(last,), worker_gpus=gpus, entrypoint={"kind": "script", "path": "sees.py"}, script_path=probe
    )
    record = run_node(tmp_path, spec)
    assert_succeeded(record)
    out = record.output
    mine = uuid_of(gpus[last])
    assert "initialised False" in out, out[-3000:]  # the pre-flight left CUDA to the script
    assert "count 1" in out and f"visible {mine}" in out and "sum 1024.0" in out, out[-3000:]
    listed = re.findall(r"\(UUID: (GPU-[0-9a-f-]+)\)", out)
    assert listed == [mine], (listed, mine)  # nvidia-smi inside agrees: that card, and only it


def test_a_builtin_job_on_the_hosts_last_gpu_trains_there(tmp_path: Path) -> None:
    gpus = worker_gpus()
    last = len(gpus) - 1
    record = run_node(tmp_path, NodeSpec(slots=(last,), worker_gpus=gpus, hyperparameters=HYPER))
    assert_succeeded(record)
    (line,) = record.placements()
    assert line.startswith("cuda:0 (") and uuid_of(gpus[last]) in line, line
    assert learned(record), record.progress()


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_ddp_with_amp_accumulation_and_clipping(tmp_path: Path, amp: str) -> None:
    gpus = worker_gpus()
    slots = tuple(range(min(2, len(gpus))))
    hyper = {**HYPER, "amp": amp, "grad_accum_steps": 2, "clip_grad_norm": 1.0}
    record = run_node(tmp_path, NodeSpec(mode="ddp", slots=slots, worker_gpus=gpus, hyperparameters=hyper))
    assert_succeeded(record)
    assert learned(record), record.progress()
    ckpt = record.last_checkpoint()
    if amp == "fp16":  # the GradScaler's state is saved, and clipping saw unscaled gradients
        assert ckpt["meta"].get("grad_scaler"), list(ckpt["meta"])
    for name, tensor in ckpt["state_dict"]["net"].items():
        assert torch.isfinite(tensor).all(), name


def test_compile_trains_in_the_sandbox(tmp_path: Path) -> None:
    gpus = worker_gpus()
    hyper = {**HYPER, "compile": True}
    record = run_node(tmp_path, NodeSpec(slots=(0,), worker_gpus=gpus, hyperparameters=hyper))
    assert_succeeded(record)
    assert learned(record), record.progress()


def test_loader_workers_with_pinned_memory(tmp_path: Path) -> None:
    gpus = worker_gpus()
    hyper = {**HYPER, "num_workers": 2}
    record = run_node(tmp_path, NodeSpec(slots=(0,), worker_gpus=gpus, hyperparameters=hyper))
    assert_succeeded(record)
    assert learned(record), record.progress()


def test_fsdp_saves_dcp_folders_in_the_sandbox_that_resume_on_one_gpu(tmp_path: Path) -> None:
    gpus = worker_gpus()
    n = min(2, len(gpus))
    spec = NodeSpec(mode="fsdp", slots=tuple(range(n)), worker_gpus=gpus, hyperparameters=HYPER)
    record = run_node(tmp_path / "a", spec)
    assert_succeeded(record)
    files = record.folders["epoch-0002"]
    assert ".metadata" in files, sorted(files)
    assert sorted(p for p in files if p.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(n)]
    folder = record.written(tmp_path / "ckpts") / "epoch-0002"
    three = {**HYPER, "epochs": 3}
    one = NodeSpec(mode="fsdp", slots=(0,), worker_gpus=gpus, hyperparameters=three, resume=folder)
    resumed = run_node(tmp_path / "b", one)
    assert_succeeded(resumed)
    assert "resuming at epoch 2" in resumed.output, resumed.output[-4000:]
    assert ".metadata" in resumed.folders["epoch-0003"]


@two_gpus
def test_sigterm_over_nccl_checkpoints_and_resumes_at_another_world_size(tmp_path: Path) -> None:
    gpus = worker_gpus()
    long = {**HYPER, "epochs": 200, "checkpoint_every": 10_000}  # saved only when stopped
    ddp = NodeSpec(mode="ddp", slots=(0, 1), worker_gpus=gpus, hyperparameters=long, stop_grace_s=60)
    stopped = run_node(tmp_path / "a", ddp, stop_when=lambda r: len(r.progress()) >= 2)
    assert stopped.outcome is not None and stopped.outcome.error == "preempted", stopped.output[-4000:]
    assert stopped.checkpoints, stopped.output[-4000:]  # rank 0 saved at SIGTERM, within the grace
    name, blob = list(stopped.checkpoints.items())[-1]
    resume = tmp_path / name
    resume.write_bytes(blob)
    single = NodeSpec(slots=(0,), worker_gpus=gpus, hyperparameters={**long, "epochs": 1}, resume=resume)
    resumed = run_node(tmp_path / "b", single)
    assert_succeeded(resumed)
    assert "resuming at epoch" in resumed.output, resumed.output[-4000:]


@two_gpus
def test_two_nodes_of_one_job_from_two_workers_on_one_host(tmp_path: Path) -> None:
    """Each node its own worker's (a GPU each, a sandbox each), NCCL between the two sandboxes."""
    gpus = worker_gpus()
    port = free_port()
    one_job = {"mode": "ddp", "nnodes": 2, "master_port": port, "hyperparameters": HYPER}
    specs = [NodeSpec(node_rank=r, worker_gpus=(gpu,), **one_job) for r, gpu in enumerate(gpus[:2])]
    node0, node1 = run_nodes(tmp_path, specs)
    assert_succeeded(node0)
    assert_succeeded(node1)
    assert node0.last_checkpoint()["meta"]["world_size"] == 2
    (line,) = node1.placements()
    assert uuid_of(gpus[1]) in line and "backend nccl" in line, line
