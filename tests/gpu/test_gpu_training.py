"""On a CUDA host only (issues #22, #37): single on cuda:0, ddp with nccl, fp16 with its
GradScaler resumed, bf16, and DataParallel over two GPUs, each launched as a worker launches
it: the real torchrun in the worker's real sandbox (tests/workers/launcher/worker_node.py).

The CPU half of each (resume exactness, the checkpoint format, SyncBN numerics) is in
tests/workers/runtime. Exactness is not asked of a GPU resume: cuDNN's default kernels are
not deterministic, so weights are compared by how far they drift, and the GradScaler's state,
which resume must carry over, is compared exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.gpu.test_gpu_sandboxed import learned, worker_gpus
from tests.workers.launcher.worker_node import NodeRecord, NodeSpec, assert_succeeded, run_node
from tests.workers.runtime.test_runtime_syncbn import (
    LOWP_CASES,
    MOMENT_CASES,
    _assert_lowp_matches_float64,
    _assert_matches_global_batchnorm,
    _lowp_inputs,
    _moment_inputs,
    _moment_layer,
)
from workers.runtime.trainer.syncbn import DataParallelWithSyncBN, convert_replica_batchnorm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bash .ci/gpu)")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel needs two GPUs")
HYPER = {"epochs": 2, "batch_size": 64, "num_workers": 0, "synthetic_size": 2048, "report_every": 4}


def on_gpus(
    tmp_path: Path, mode: str = "single", gpus: int = 1, resume: Path | None = None, **hyper: Any
) -> NodeRecord:
    """A builtin job on the first `gpus` slots of a worker holding this host's GPUs, to its end."""
    spec = NodeSpec(
        mode=mode,
        slots=tuple(range(gpus)),
        worker_gpus=worker_gpus(),
        hyperparameters={**HYPER, **hyper},
        resume=resume,
    )
    record = run_node(tmp_path, spec)
    assert_succeeded(record)
    return record


def loaded(folder: Path, name: str) -> dict[str, Any]:
    return torch.load(folder / name, weights_only=True)


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k].float() - b[k].float()).norm()) for k in a if a[k].is_floating_point())


def test_single_trains_on_cuda_0(tmp_path: Path) -> None:
    record = on_gpus(tmp_path)
    (line,) = record.placements()
    assert line.startswith("cuda:0 (") and line.endswith("backend none (one process)"), line
    ckpt = record.last_checkpoint()
    assert ckpt["meta"]["accelerator"] == "cuda"
    # written from the GPU, loadable anywhere: every tensor on the CPU, no wrapper prefix
    assert all(t.device.type == "cpu" for t in ckpt["state_dict"]["net"].values())
    assert not any(k.startswith("module.") for k in ckpt["state_dict"]["net"])
    assert learned(record), record.progress()


def test_ddp_runs_one_process_per_gpu_over_nccl(tmp_path: Path) -> None:
    n = min(2, torch.cuda.device_count())
    record = on_gpus(tmp_path, "ddp", gpus=n)
    lines = record.placements()
    assert sorted(line.split(" ")[0] for line in lines) == [f"cuda:{i}" for i in range(n)], lines
    assert all(line.endswith("backend nccl") for line in lines), lines
    ckpt = record.last_checkpoint()
    assert ckpt["meta"]["world_size"] == n
    assert not any(k.startswith("module.") for k in ckpt["state_dict"]["net"])


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """4 epochs straight, and the same job resumed from its own epoch-2 checkpoint: the
    checkpoint folders of both, and the resumed run's output."""
    root = tmp_path_factory.mktemp("fp16")
    straight = on_gpus(root / "straight", epochs=4, amp="fp16").written(root / "straight-ckpts")
    resumed = on_gpus(root / "resumed", epochs=4, amp="fp16", resume=straight / "epoch-0002.pt")
    return straight, resumed.written(root / "resumed-ckpts"), resumed.output


def test_fp16_saves_its_grad_scaler(fp16_runs: tuple[Path, Path, str]) -> None:
    straight, _, _ = fp16_runs
    scaler = loaded(straight, "epoch-0002.pt")["meta"]["grad_scaler"]
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] > 0, scaler


def test_fp16_resume_carries_the_scaler_on_and_lands_where_the_straight_run_did(
    fp16_runs: tuple[Path, Path, str],
) -> None:
    straight, resumed, output = fp16_runs
    assert "resuming at epoch 2" in output
    a, b = loaded(straight, "epoch-0004.pt"), loaded(resumed, "epoch-0004.pt")
    assert a["step"] == b["step"]
    # a scaler started afresh would count its growth steps from the resume, not from the start
    assert a["meta"]["grad_scaler"] == b["meta"]["grad_scaler"]
    trained = distance(a["state_dict"]["net"], loaded(straight, "epoch-0002.pt")["state_dict"]["net"])
    assert distance(a["state_dict"]["net"], b["state_dict"]["net"]) < 0.1 * trained


def test_bf16_autocast_trains_on_the_gpu(tmp_path: Path) -> None:
    record = on_gpus(tmp_path, amp="bf16")
    assert "grad_scaler" not in record.last_checkpoint()["meta"]
    assert learned(record), record.progress()


@two_gpus
def test_dp_splits_each_batch_over_two_gpus(tmp_path: Path) -> None:
    record = on_gpus(tmp_path, "dp", gpus=2)
    (line,) = record.placements()
    assert "cuda:0 (" in line and "cuda:1 (" in line, line
    assert "single-process training" not in record.output
    ckpt = record.last_checkpoint()
    assert ckpt["meta"]["mode"] == "dp"
    assert not any(k.startswith("module.") for k in ckpt["state_dict"]["net"])


def dataparallel_syncbn(
    kind: str, x: torch.Tensor, backward: Callable[[torch.Tensor], None]
) -> dict[str, torch.Tensor]:
    """One synchronised BatchNorm under DataParallel over GPUs 0 and 1, fed `x`: its output,
    gradients and running variance, on the CPU."""
    layer = convert_replica_batchnorm(
        nn.Sequential(_moment_layer(nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d))
    ).cuda()
    model = DataParallelWithSyncBN(layer.train(), device_ids=[0, 1])
    x = x.cuda().requires_grad_()
    out = model(x)
    backward(out)
    bn = layer[0]
    assert x.grad is not None and bn.weight.grad is not None and bn.bias.grad is not None
    return {
        "out": out.detach().cpu(),
        "x_grad": x.grad.cpu(),
        "weight_grad": bn.weight.grad.cpu(),
        "bias_grad": bn.bias.grad.cpu(),
        "running_var": bn.running_var.cpu(),
    }


@two_gpus
@pytest.mark.parametrize(("kind", "spread"), MOMENT_CASES)
def test_dataparallel_syncbn_on_two_gpus_matches_one_batchnorm(kind: str, spread: str) -> None:
    """The CPU test of the same name runs the replicas in threads; here DataParallel runs them."""
    x, proj = _moment_inputs(kind, spread, 8)
    got = dataparallel_syncbn(kind, x, lambda out: (out * proj.cuda()).sum().backward())
    _assert_matches_global_batchnorm(got, kind, spread)


@two_gpus
@pytest.mark.parametrize(("kind", "dtype"), LOWP_CASES)
def test_dataparallel_syncbn_in_low_precision_on_two_gpus_sums_in_float32(
    kind: str, dtype: torch.dtype
) -> None:
    """fp16 and bf16 inputs (as autocast hands them on): statistics and parameter gradients
    summed in float32, against native BatchNorm in float64 (issue #37)."""
    x, dy = _lowp_inputs(kind, dtype)
    got = dataparallel_syncbn(kind, x, lambda out: out.backward(dy.cuda()))
    _assert_lowp_matches_float64(got, kind, dtype)
