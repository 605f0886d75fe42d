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

from workers.runtime.syncbn import (
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
        results = {f"{kind}-{momentum}": _ddp_case(rank, kind, momentum) for kind, momentum in DDP_CASES}
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
