"""Synchronised BatchNorm against the reference it must equal: one plain BatchNorm over the
whole global batch — forward output, input and parameter gradients, running statistics."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from workers.runtime.trainer.syncbn import (
    DistributedBatchNorm,
    ReplicaSyncBatchNorm,
    attach_replica_sync,
    convert_distributed_batchnorm,
    convert_replica_batchnorm,
    guard_replicas,
)

ATOL = 1e-5


def _model(kind: str, momentum: float | None) -> nn.Module:
    """Small nets with BatchNorm in the middle, so gradients reach it from above and flow below.
    (No bias right before a BatchNorm: its true gradient is zero, so only rounding noise is left.)"""
    torch.manual_seed(0)
    if kind == "2d":
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1, bias=False),
            nn.BatchNorm2d(3, momentum=momentum),
            nn.ReLU(),
            nn.Conv2d(3, 4, 1, bias=False),
            nn.BatchNorm2d(4, momentum=momentum),
        )
    else:
        model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.BatchNorm1d(5, momentum=momentum), nn.Tanh())
    for m in model.modules():  # non-trivial affine parameters
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model


def _inputs(kind: str, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, a fixed random projection of the output that makes the loss)."""
    g = torch.Generator().manual_seed(100 + step)
    if kind == "2d":
        return torch.randn(batch, 2, 4, 4, generator=g) * 3 + 1, torch.randn(batch, 4, 4, 4, generator=g)
    return torch.randn(batch, 6, generator=g) * 2 - 1, torch.randn(batch, 5, generator=g)


def _bn_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def _reference(kind: str, momentum: float | None, sizes: list[int], steps: int) -> list[dict[str, Any]]:
    """What one plain model does with the whole batch; one record per step."""
    model = _model(kind, momentum)
    records = []
    for step in range(steps):
        x, proj = _inputs(kind, sum(sizes), step)
        x.requires_grad_()
        model.zero_grad()
        out = model(x)
        (out * proj).sum().backward()
        records.append(
            {
                "out": out.detach(),
                "x_grad": x.grad.clone(),
                "param_grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "buffers": {k: v.clone() for k, v in _bn_buffers(model).items()},
            }
        )
    return records


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=ATOL, msg=what)


# ------------------------------------------------------------------------------------------ DataParallel


def cpu_replicate(network: nn.Module, copies: int) -> list[nn.Module]:
    """torch.nn.parallel.replicate, on CPU: DataParallel's replicas as it builds them.

    Parameters become non-leaf views whose gradients flow back into the original (Broadcast's
    backward sums them the same way); replica 0 shares the original buffers, the others get
    copies, as the broadcast to device 0 returns the source tensors.
    """
    modules = list(network.modules())
    index = {m: i for i, m in enumerate(modules)}
    replicas = [[m._replicate_for_data_parallel() for m in modules] for _ in range(copies)]
    for i, module in enumerate(modules):
        for j in range(copies):
            replica = replicas[j][i]
            for key, child in module._modules.items():
                setattr(replica, key, replicas[j][index[child]])
            for key, param in module._parameters.items():
                setattr(replica, key, None if param is None else param.view_as(param))
            for key, buf in module._buffers.items():
                setattr(replica, key, buf if j == 0 or buf is None else buf.clone())
    return [r[0] for r in replicas]


def parallel_apply_cpu(replicas: list[Callable[..., Any]], inputs: list[torch.Tensor]) -> list[Any]:
    """torch.nn.parallel.parallel_apply's threading (which itself insists on an accelerator)."""
    results: dict[int, Any] = {}
    grad_enabled = torch.is_grad_enabled()

    def work(i: int) -> None:
        torch.set_grad_enabled(grad_enabled)
        try:
            results[i] = replicas[i](inputs[i])
        except Exception as exc:  # pragma: no cover - reported below
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i in range(len(replicas)):
        if isinstance(results.get(i), Exception):
            raise results[i]
    return [results[i] for i in range(len(replicas))]


@pytest.mark.parametrize("kind", ["2d", "1d"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_dataparallel_replicas_match_one_batchnorm_over_the_whole_batch(
    kind: str, momentum: float | None
) -> None:
    sizes, steps = [3, 5, 4], 3
    expected = _reference(kind, momentum, sizes, steps)
    model = convert_replica_batchnorm(_model(kind, momentum))
    for step in range(steps):
        x, proj = _inputs(kind, sum(sizes), step)
        x.requires_grad_()
        model.zero_grad()
        replicas = cpu_replicate(model, len(sizes))
        syncs = attach_replica_sync(replicas)  # what DataParallelWithSyncBN.replicate adds
        outs = parallel_apply_cpu(
            guard_replicas(replicas, syncs), list(x.split(sizes))
        )  # ...and parallel_apply
        out = torch.cat(outs)  # DataParallel's gather
        (out * proj).sum().backward()
        ref = expected[step]
        _close(out.detach(), ref["out"], f"output, step {step}")
        _close(x.grad, ref["x_grad"], f"input grad, step {step}")
        for name, p in model.named_parameters():
            _close(p.grad, ref["param_grads"][name], f"{name}.grad, step {step}")
        for name, buf in _bn_buffers(model).items():
            _close(buf.double(), ref["buffers"][name].double(), f"{name}, step {step}")


def test_a_failing_replica_releases_its_siblings_at_once() -> None:
    model = convert_replica_batchnorm(_model("2d", 0.1))
    replicas = cpu_replicate(model, 2)
    syncs = attach_replica_sync(replicas)

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise MemoryError("replica 1 ran out of memory")

    x, _ = _inputs("2d", 4, 0)
    started = time.monotonic()
    results = {}

    def work(i: int, fn: Callable[..., Any]) -> None:
        try:
            results[i] = fn(x[i * 2 : i * 2 + 2])
        except BaseException as exc:
            results[i] = exc

    threads = [
        threading.Thread(target=work, args=(i, fn))
        for i, fn in enumerate(guard_replicas([replicas[0], broken], syncs))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert isinstance(results[1], MemoryError)
    assert isinstance(results[0], RuntimeError) and "did not reach synchronised BatchNorm" in str(results[0])
    assert time.monotonic() - started < 10  # not the barrier's 300 s timeout


def test_replica_batchnorm_outside_dataparallel_is_plain_batchnorm() -> None:
    plain = _model("2d", 0.1)
    converted = convert_replica_batchnorm(copy.deepcopy(plain))
    assert any(isinstance(m, ReplicaSyncBatchNorm) for m in converted.modules())
    x, _ = _inputs("2d", 6, 0)
    for mode in ("train", "eval"):
        getattr(plain, mode)(), getattr(converted, mode)()
        assert torch.equal(plain(x), converted(x))
    assert plain.state_dict().keys() == converted.state_dict().keys()


def test_conversion_keeps_the_same_parameter_and_buffer_tensors() -> None:
    model = _model("2d", 0.1)
    bn = model[1]
    converted = convert_distributed_batchnorm(model)
    assert isinstance(converted[1], DistributedBatchNorm)
    assert converted[1].weight is bn.weight and converted[1].running_var is bn.running_var


# ------------------------------------------------------------------------------------------ DDP on CPU


DDP_CASES = [("2d", 0.1), ("1d", None)]  # both in one pair of processes: spawning costs seconds
DDP_SIZES, DDP_STEPS = [3, 5], 2  # unequal local batches: statistics must weight by count


def _ddp_rank(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results: dict[str, Any] = {
            f"{kind}-{momentum}": _ddp_case(rank, kind, momentum) for kind, momentum in DDP_CASES
        }
        for kind, spread in MOMENT_CASES:
            results[f"moments-{kind}-{spread}"] = _moments_case(
                DistributedBatchNorm, rank, kind, spread, MOMENT_SIZES
            )
        for kind, dtype in LOWP_CASES:
            results[f"lowp-{kind}-{dtype}"] = _lowp_case(DistributedBatchNorm, rank, kind, dtype)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _ddp_case(rank: int, kind: str, momentum: float | None) -> list[dict[str, Any]]:
    model = convert_distributed_batchnorm(_model(kind, momentum))
    start, size = sum(DDP_SIZES[:rank]), DDP_SIZES[rank]
    records = []
    for step in range(DDP_STEPS):
        x, proj = _inputs(kind, sum(DDP_SIZES), step)
        x = x[start : start + size].clone().requires_grad_()
        model.zero_grad()
        out = model(x)
        (out * proj[start : start + size]).sum().backward()
        records.append(
            {
                "out": out.detach(),
                "x_grad": x.grad.clone(),
                "param_grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "buffers": {k: v.clone() for k, v in _bn_buffers(model).items()},
            }
        )
    return records


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's records of every case, from 2 spawned gloo processes."""
    folder = tmp_path_factory.mktemp("ddp-bn")
    init = f"file://{folder / 'store'}"
    mp.start_processes(_ddp_rank, args=(2, init, str(folder)), nprocs=2, start_method="spawn")
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize(("kind", "momentum"), DDP_CASES)
def test_cpu_ddp_batchnorm_matches_one_batchnorm_over_the_global_batch(
    ddp_ranks: list[dict[str, Any]], kind: str, momentum: float | None
) -> None:
    per_rank = [r[f"{kind}-{momentum}"] for r in ddp_ranks]
    expected = _reference(kind, momentum, DDP_SIZES, DDP_STEPS)
    for step in range(DDP_STEPS):
        ref, got = expected[step], [r[step] for r in per_rank]
        _close(torch.cat([g["out"] for g in got]), ref["out"], f"output, step {step}")
        _close(torch.cat([g["x_grad"] for g in got]), ref["x_grad"], f"input grad, step {step}")
        for name, grad in ref["param_grads"].items():
            # each rank holds its own batch's share; DDP sums (averages) them across ranks
            _close(got[0]["param_grads"][name] + got[1]["param_grads"][name], grad, f"{name}.grad")
        for name, buf in ref["buffers"].items():
            assert torch.equal(got[0]["buffers"][name], got[1]["buffers"][name]), name
            _close(got[0]["buffers"][name].double(), buf.double(), f"{name}, step {step}")


# ------------------------------------------------------------------------------------------ stable variance
#
# Inputs far from zero relative to their spread: E[x^2] - E[x]^2 loses every significant digit
# there (the layer then normalised by a variance off by orders of magnitude). Both layers must
# match one BatchNorm over the global batch evaluated in float64, i.e. the exact answer for these
# float32 inputs; native float32 BatchNorm itself is only within about 5e-3 of it here (it cannot
# hold the mean 1e3 to better than half an ulp, 3e-5, and multiplies that by invstd = 100), so
# it is the float64 evaluation, not the float32 one, that a 1e-3 tolerance can be held to.

MOMENT_CASES = [("2d", "shifted"), ("1d", "shifted"), ("2d", "centred"), ("1d", "centred")]
MOMENT_SIZES = [5, 3]  # unequal local batches: the merge must weight replicas by their counts
SPREADS = {"shifted": (1e3, 0.01), "centred": (0.0, 1.0)}


def _moment_inputs(kind: str, spread: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 input with the spread's mean and std per channel, a projection making the loss)."""
    mean, std = SPREADS[spread]
    g = torch.Generator().manual_seed(7)
    shape = (batch, 3, 4, 4) if kind == "2d" else (batch, 3)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * std + mean).float()
    return x, torch.randn(shape, generator=g)


def _moment_layer(cls: type[nn.Module]) -> nn.Module:
    layer = cls(3)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([0.5, 1.0, 1.5]))
        layer.bias.copy_(torch.tensor([-0.25, 0.0, 0.25]))
    return layer


def _moments_case(
    cls: type[nn.Module], rank: int, kind: str, spread: str, sizes: list[int]
) -> dict[str, torch.Tensor]:
    layer = _moment_layer(cls).train()
    x, proj = _moment_inputs(kind, spread, sum(sizes))
    start = sum(sizes[:rank])
    mine = x[start : start + sizes[rank]].clone().requires_grad_()
    out = layer(mine)
    (out * proj[start : start + sizes[rank]]).sum().backward()
    return {
        "out": out.detach(),
        "x_grad": mine.grad.clone(),
        "weight_grad": layer.weight.grad.clone(),
        "bias_grad": layer.bias.grad.clone(),
        "running_var": layer.running_var.clone(),
    }


def _moments_reference(
    kind: str, spread: str, sizes: list[int], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One native BatchNorm over the whole batch, evaluated in `dtype`."""
    layer = _moment_layer(nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d).to(dtype).train()
    x, proj = _moment_inputs(kind, spread, sum(sizes))
    x = x.to(dtype).requires_grad_()
    out = layer(x)
    (out * proj.to(dtype)).sum().backward()
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "weight_grad": layer.weight.grad,
        "bias_grad": layer.bias.grad,
        "running_var": layer.running_var,
    }


def _assert_matches_global_batchnorm(got: dict[str, torch.Tensor], kind: str, spread: str) -> None:
    exact = _moments_reference(kind, spread, MOMENT_SIZES, torch.float64)
    if spread == "shifted":
        assert exact["x_grad"].abs().max() > 100  # invstd is 100: a real test of 1e-3, not of rounding
        for key in ("out", "x_grad", "weight_grad", "bias_grad"):
            torch.testing.assert_close(got[key].double(), exact[key], rtol=0.0, atol=1e-3, msg=key)
        torch.testing.assert_close(got["running_var"].double(), exact["running_var"], rtol=1e-4, atol=0.0)
    else:  # well-centred: as close to native float32 BatchNorm as float32 rounding allows
        native = _moments_reference(kind, spread, MOMENT_SIZES, torch.float32)
        for key in ("out", "x_grad", "weight_grad", "bias_grad", "running_var"):
            torch.testing.assert_close(got[key], native[key], rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize(("kind", "spread"), MOMENT_CASES)
def test_cpu_ddp_batchnorm_variance_is_stable_far_from_zero(
    ddp_ranks: list[dict[str, Any]], kind: str, spread: str
) -> None:
    got = [r[f"moments-{kind}-{spread}"] for r in ddp_ranks]
    assert torch.equal(got[0]["running_var"], got[1]["running_var"])
    merged = {
        "out": torch.cat([g["out"] for g in got]),
        "x_grad": torch.cat([g["x_grad"] for g in got]),
        # each rank holds its own batch's share of the parameter gradients; DDP sums them
        "weight_grad": got[0]["weight_grad"] + got[1]["weight_grad"],
        "bias_grad": got[0]["bias_grad"] + got[1]["bias_grad"],
        "running_var": got[0]["running_var"],
    }
    _assert_matches_global_batchnorm(merged, kind, spread)


@pytest.mark.parametrize(("kind", "spread"), MOMENT_CASES)
def test_dataparallel_batchnorm_variance_is_stable_far_from_zero(kind: str, spread: str) -> None:
    """The DataParallel layer's exchange, its merge and its backward (autograd through the
    exchange), with CPU replicas in threads as DataParallel would run them on GPUs."""
    layer = convert_replica_batchnorm(
        nn.Sequential(_moment_layer(nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d))
    )
    x, proj = _moment_inputs(kind, spread, sum(MOMENT_SIZES))
    x.requires_grad_()
    replicas = cpu_replicate(layer.train(), len(MOMENT_SIZES))
    syncs = attach_replica_sync(replicas)
    out = torch.cat(parallel_apply_cpu(guard_replicas(replicas, syncs), list(x.split(MOMENT_SIZES))))
    (out * proj).sum().backward()
    bn = layer[0]
    got = {
        "out": out.detach(),
        "x_grad": x.grad,
        "weight_grad": bn.weight.grad,
        "bias_grad": bn.bias.grad,
        "running_var": bn.running_var,
    }
    _assert_matches_global_batchnorm(got, kind, spread)


# ------------------------------------------------------------------------------------------ low precision
#
# Under autocast the activations reaching BatchNorm are fp16 or bf16 while its parameters stay
# float32. Native BatchNorm computes its statistics and its weight and bias gradient sums in
# float32 and rounds only the output and the input gradient; so must both synchronised layers.
# The fp16 cases carry gradients as GradScaler leaves them (scaled up): per channel their sum
# passes fp16's largest value, 65504, and was `inf` when the layer summed in fp16.

LOWP_CASES = [("2d", torch.bfloat16), ("2d", torch.float16), ("1d", torch.bfloat16)]
LOWP_SIZES = [6, 2]
FP16_GRAD_SCALE = 1024.0


def _lowp_inputs(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(input in `dtype`, the incoming gradient in `dtype`: positive, so its sums grow)."""
    g = torch.Generator().manual_seed(11)
    shape = (sum(LOWP_SIZES), 3, 4, 4) if kind == "2d" else (sum(LOWP_SIZES), 3)
    x = (torch.randn(shape, generator=g) * 2.0 + 0.5).to(dtype)
    scale = FP16_GRAD_SCALE if dtype == torch.float16 else 1.0
    dy = ((torch.rand(shape, generator=g) + 0.5) * scale).to(dtype)
    return x, dy


def _lowp_run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(dy)
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "weight_grad": layer.weight.grad,
        "bias_grad": layer.bias.grad,
        "running_var": layer.running_var.clone(),
    }


def _lowp_case(cls: type[nn.Module], rank: int, kind: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    x, dy = _lowp_inputs(kind, dtype)
    start = sum(LOWP_SIZES[:rank])
    mine = slice(start, start + LOWP_SIZES[rank])
    return _lowp_run(_moment_layer(cls).train(), x[mine], dy[mine])


def _assert_lowp_matches_float64(got: dict[str, torch.Tensor], kind: str, dtype: torch.dtype) -> None:
    x, dy = _lowp_inputs(kind, dtype)
    native = _moment_layer(nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d).double().train()
    exact = _lowp_run(native, x.double(), dy.double())
    if dtype == torch.float16:
        assert exact["bias_grad"].abs().max() > 65504  # past fp16: a real test of the float32 sums
    for key in ("weight_grad", "bias_grad"):  # float32, like the parameters: no rounding to dtype
        assert got[key].dtype == torch.float32, key
        torch.testing.assert_close(got[key].double(), exact[key], rtol=1e-5, atol=1e-5, msg=key)
    torch.testing.assert_close(got["running_var"].double(), exact["running_var"], rtol=1e-5, atol=1e-6)
    ulp = torch.finfo(dtype).eps
    for key in ("out", "x_grad"):  # rounded once, to the input's dtype
        assert got[key].dtype == dtype, key
        bound = ulp * float(exact[key].abs().max())
        torch.testing.assert_close(got[key].double(), exact[key], rtol=ulp, atol=bound, msg=key)


@pytest.mark.parametrize(("kind", "dtype"), LOWP_CASES)
def test_cpu_ddp_batchnorm_in_low_precision_sums_in_float32(
    ddp_ranks: list[dict[str, Any]], kind: str, dtype: torch.dtype
) -> None:
    got = [r[f"lowp-{kind}-{dtype}"] for r in ddp_ranks]
    merged = {
        "out": torch.cat([g["out"] for g in got]),
        "x_grad": torch.cat([g["x_grad"] for g in got]),
        "weight_grad": got[0]["weight_grad"] + got[1]["weight_grad"],
        "bias_grad": got[0]["bias_grad"] + got[1]["bias_grad"],
        "running_var": got[0]["running_var"],
    }
    _assert_lowp_matches_float64(merged, kind, dtype)


@pytest.mark.parametrize(("kind", "dtype"), LOWP_CASES)
def test_dataparallel_batchnorm_in_low_precision_sums_in_float32(kind: str, dtype: torch.dtype) -> None:
    layer = convert_replica_batchnorm(
        nn.Sequential(_moment_layer(nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d))
    )
    x, dy = _lowp_inputs(kind, dtype)
    x.requires_grad_()
    replicas = cpu_replicate(layer.train(), len(LOWP_SIZES))
    syncs = attach_replica_sync(replicas)
    out = torch.cat(parallel_apply_cpu(guard_replicas(replicas, syncs), list(x.split(LOWP_SIZES))))
    out.backward(dy)
    bn = layer[0]
    got = {
        "out": out.detach(),
        "x_grad": x.grad,
        "weight_grad": bn.weight.grad,
        "bias_grad": bn.bias.grad,
        "running_var": bn.running_var,
    }
    _assert_lowp_matches_float64(got, kind, dtype)
