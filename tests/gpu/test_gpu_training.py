"""On a CUDA host only (issue #22): single on cuda:0, ddp with nccl, fp16 with its GradScaler
resumed, bf16, and DataParallel over two GPUs, each launched by the real torchrun.

The CPU half of each (resume exactness, the checkpoint format, SyncBN numerics) is in
tests/workers/runtime. Exactness is not asked of a GPU resume: cuDNN's default kernels are
not deterministic, so weights are compared by how far they drift, and the GradScaler's state,
which resume must carry over, is compared exactly.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from tests.workers.runtime.test_runtime_syncbn import (
    MOMENT_CASES,
    _assert_matches_global_batchnorm,
    _moment_inputs,
    _moment_layer,
)
from workers.runtime.trainer.syncbn import DataParallelWithSyncBN, convert_replica_batchnorm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bash .ci/gpu)")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel needs two GPUs")


def cuda_config(jobs: Any, mode: str = "single", gpus: int = 1, **hyper: Any) -> dict[str, Any]:
    config = jobs.config(mode, **hyper)
    config.update(accelerator="cuda", gpus_per_node=gpus)
    return config


def placements(run: Any) -> list[str]:
    """The ranks' `placement:` log lines (workers/runtime/trainer/distributed.describe_placement)."""
    return re.findall(r"\] placement: (.*)", run.output)


def net_of(path: Any) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]["net"]


def learned(run: Any) -> bool:
    """The loss fell: the mean of the last two reports under that of the first two (on the CPU
    the same job goes from 2.31 to 2.13; one report alone is noisy)."""
    losses = [e["loss"] for e in run.events()]
    return sum(losses[-2:]) < sum(losses[:2])


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k].float() - b[k].float()).norm()) for k in a if a[k].is_floating_point())


def test_single_trains_on_cuda_0(jobs: Any, tmp_path: Any) -> None:
    run = jobs.start(tmp_path / "single", cuda_config(jobs, epochs=2)).ok()
    (line,) = placements(run)
    assert line.startswith("cuda:0 (") and line.endswith("backend none (one process)"), line
    ckpt = torch.load(run.latest_checkpoint(), weights_only=True)
    assert ckpt["meta"]["accelerator"] == "cuda"
    # written from the GPU, loadable anywhere: every tensor on the CPU, no wrapper prefix
    assert all(t.device.type == "cpu" for t in ckpt["state_dict"]["net"].values())
    assert not any(k.startswith("module.") for k in ckpt["state_dict"]["net"])
    assert learned(run)


def test_ddp_runs_one_process_per_gpu_over_nccl(jobs: Any, tmp_path: Any) -> None:
    n = min(2, torch.cuda.device_count())
    run = jobs.start(tmp_path / "ddp", cuda_config(jobs, "ddp", gpus=n, epochs=2), nproc=n).ok()
    lines = placements(run)
    assert sorted(line.split(" ")[0] for line in lines) == [f"cuda:{i}" for i in range(n)], lines
    assert all(line.endswith("backend nccl") for line in lines), lines
    ckpt = torch.load(run.latest_checkpoint(), weights_only=True)
    assert ckpt["meta"]["world_size"] == n
    assert not any(k.startswith("module.") for k in ckpt["state_dict"]["net"])


@pytest.fixture(scope="module")
def fp16_runs(jobs: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """4 epochs straight, and the same job resumed from its own epoch-2 checkpoint."""
    root = tmp_path_factory.mktemp("fp16")
    config = cuda_config(jobs, epochs=4, amp="fp16")
    straight = jobs.start(root / "straight", config).ok()
    resumed = jobs.start(root / "resumed", config, resume=straight.checkpoints / "epoch-0002.pt").ok()
    return straight, resumed


def test_fp16_saves_its_grad_scaler(fp16_runs: tuple[Any, Any]) -> None:
    straight, _ = fp16_runs
    meta = torch.load(straight.checkpoints / "epoch-0002.pt", weights_only=True)["meta"]
    scaler = meta["grad_scaler"]
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] > 0, scaler


def test_fp16_resume_carries_the_scaler_on_and_lands_where_the_straight_run_did(
    fp16_runs: tuple[Any, Any],
) -> None:
    straight, resumed = fp16_runs
    assert "resuming at epoch 2" in resumed.output
    a = torch.load(straight.checkpoints / "epoch-0004.pt", weights_only=True)
    b = torch.load(resumed.checkpoints / "epoch-0004.pt", weights_only=True)
    assert a["step"] == b["step"]
    # a scaler started afresh would count its growth steps from the resume, not from the start
    assert a["meta"]["grad_scaler"] == b["meta"]["grad_scaler"]
    trained = distance(a["state_dict"]["net"], net_of(straight.checkpoints / "epoch-0002.pt"))
    assert distance(a["state_dict"]["net"], b["state_dict"]["net"]) < 0.1 * trained


def test_bf16_autocast_trains_on_the_gpu(jobs: Any, tmp_path: Any) -> None:
    run = jobs.start(tmp_path / "bf16", cuda_config(jobs, epochs=2, amp="bf16")).ok()
    assert "grad_scaler" not in torch.load(run.latest_checkpoint(), weights_only=True)["meta"]
    assert learned(run)


@two_gpus
def test_dp_splits_each_batch_over_two_gpus(jobs: Any, tmp_path: Any) -> None:
    run = jobs.start(tmp_path / "dp", cuda_config(jobs, "dp", gpus=2, epochs=2)).ok()
    (line,) = placements(run)
    assert "cuda:0 (" in line and "cuda:1 (" in line, line
    assert "single-process training" not in run.output
    ckpt = torch.load(run.latest_checkpoint(), weights_only=True)
    assert ckpt["meta"]["mode"] == "dp"
    assert not any(k.startswith("module.") for k in ckpt["state_dict"]["net"])


@two_gpus
@pytest.mark.parametrize(("kind", "spread"), MOMENT_CASES)
def test_dataparallel_syncbn_on_two_gpus_matches_one_batchnorm(kind: str, spread: str) -> None:
    """The CPU test of the same name runs the replicas in threads; here DataParallel runs them."""
    layer = convert_replica_batchnorm(
        nn.Sequential(_moment_layer(nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d))
    ).cuda()
    model = DataParallelWithSyncBN(layer.train(), device_ids=[0, 1])
    x, proj = _moment_inputs(kind, spread, 8)
    x = x.cuda().requires_grad_()
    out = model(x)
    (out * proj.cuda()).sum().backward()
    bn = layer[0]
    got = {
        "out": out.detach().cpu(),
        "x_grad": x.grad.cpu(),
        "weight_grad": bn.weight.grad.cpu(),
        "bias_grad": bn.bias.grad.cpu(),
        "running_var": bn.running_var.cpu(),
    }
    _assert_matches_global_batchnorm(got, kind, spread)
