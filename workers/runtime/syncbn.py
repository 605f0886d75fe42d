"""Synchronised BatchNorm where PyTorch's own does not reach.

Two cases, both computing batch statistics over the *global* batch so that N small per-device
batches normalise exactly like one big one:

* `DistributedBatchNorm` — DDP on CPU. `nn.SyncBatchNorm` refuses CPU modules (its kernels are
  CUDA-only), so this autograd.Function all-reduces the per-channel sum, sum of squares and count
  in forward, and the two gradient sums in backward. On CUDA the trainer uses the native one.
* `ReplicaSyncBatchNorm` + `DataParallelWithSyncBN` — DataParallel, which the seed converts with
  `convert_model`. Replicas run in threads of one process, so torch.distributed cannot help; the
  replicas of one layer meet in a per-forward `_ReplicaSync`, where replica 0 sums everyone's
  statistics. The exchange is built from differentiable tensor ops, so autograd carries the
  gradient back across replicas by itself, with no barrier in backward (which on CPU, where the
  whole backward runs on one thread, would deadlock).

Both keep BatchNorm's parameter and buffer names, so state dicts are interchangeable with the
plain model's, and both update running statistics like native BN (unbiased variance over the
global count). Only replica 0 updates them under DataParallel: it shares its buffers with the
wrapped module, so in-place updates there persist (DataParallel's documented guarantee).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

REPLICA_TIMEOUT_S = 300.0  # how long replicas wait for a sibling that failed before giving up


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _local_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel sum and sum of squares (in float32 at least) and the element count per channel."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    dims = _reduce_dims(x)
    return xf.sum(dims), (xf * xf).sum(dims), x.numel() // x.size(1)


def _normalize(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    scale = invstd if weight is None else invstd * weight
    out = (x - _channel_view(mean, x)) * _channel_view(scale, x)
    return out if bias is None else out + _channel_view(bias, x)


class _SyncedBatchNormBase(_BatchNorm):
    """What both synchronised layers share: native BN's input check, momentum bookkeeping and
    running-statistics update; subclasses decide where the batch statistics come from."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _momentum(self) -> float:
        """Native BN's factor, counting the batch as native BN does."""
        if self.num_batches_tracked is None:
            return 0.0 if self.momentum is None else self.momentum
        self.num_batches_tracked.add_(1)
        return 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: float, factor: float) -> None:
        if self.running_mean is None or self.running_var is None:
            return
        with torch.no_grad():
            unbiased = var * (count / max(count - 1.0, 1.0))
            self.running_mean.mul_(1.0 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1.0 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


# --------------------------------------------------------------------------------------------
# DDP on CPU


class _DistributedBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        group: Any,
    ) -> tuple[torch.Tensor, ...]:
        s, ss, count = _local_stats(x)
        channels = x.size(1)
        stats = torch.cat([s, ss, s.new_tensor([float(count)])])
        dist.all_reduce(stats, group=group)
        total = stats[2 * channels]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_(min=0)
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.group = group
        ctx.mark_non_differentiable(mean, var, total)
        out = _normalize(x, mean.to(x.dtype), invstd.to(x.dtype), weight, bias)
        return out, mean, var, total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        x, weight, mean, invstd, total = ctx.saved_tensors
        dims = _reduce_dims(x)
        xmu = x - _channel_view(mean, x)
        sum_dy = grad_out.sum(dims)
        sum_dy_xmu = (grad_out * xmu).sum(dims)
        grad_weight = sum_dy_xmu * invstd if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            # The loss of every rank depends on this rank's input through the shared statistics.
            sums = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(sums, group=ctx.group)
            grad_input = _grad_input(grad_out, xmu, invstd, weight, sums, total)
        return grad_input, grad_weight, grad_bias, None, None


def _grad_input(
    grad_out: torch.Tensor,
    xmu: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    sums: torch.Tensor,
    total: torch.Tensor,
) -> torch.Tensor:
    channels = invstd.numel()
    mean_dy = sums[:channels] / total
    mean_dy_xmu = sums[channels:] / total
    scale = invstd if weight is None else invstd * weight
    centred = grad_out - _channel_view(mean_dy, grad_out)
    centred = centred - xmu * _channel_view(invstd * invstd * mean_dy_xmu, xmu)
    return centred * _channel_view(scale, grad_out)


class DistributedBatchNorm(_SyncedBatchNormBase):
    """BatchNorm over the global batch of a torch.distributed group, on any device (used on CPU)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _needs_sync(self) -> bool:
        uses_batch_stats = self.training or self.running_mean is None
        return (
            uses_batch_stats
            and self.training
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self._needs_sync():
            return super().forward(input)
        factor = self._momentum() if self.track_running_stats else 0.0
        out, mean, var, total = _DistributedBatchNormFn.apply(
            input,
            self.weight,
            self.bias,
            self.eps,
            self.process_group,
        )
        if self.track_running_stats:
            self._update_running(mean, var, float(total), factor)
        return out


# --------------------------------------------------------------------------------------------
# DataParallel


class _ReplicaSync:
    """Where the replicas of one BatchNorm layer meet during one DataParallel forward."""

    def __init__(self, replicas: int) -> None:
        self._barrier = threading.Barrier(replicas, timeout=REPLICA_TIMEOUT_S)
        self._slots: list[tuple[torch.Tensor, torch.Tensor, int] | None] = [None] * replicas
        self._result: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def exchange(
        self, replica: int, s: torch.Tensor, ss: torch.Tensor, count: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Global (mean, biased var, count), on this replica's device and differentiable.

        Two barrier waits: the first until every replica has posted, the second until replica 0
        has combined them, which also keeps a reused layer from overwriting slots still read.
        """
        self._slots[replica] = (s, ss, count)
        self._wait()
        if replica == 0:
            try:
                self._result = self._combine(s.device)
            except BaseException:
                self.abort()
                raise
        self._wait()
        assert self._result is not None
        mean, var, total = self._result
        return mean.to(s.device), var.to(s.device), total

    def _combine(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        slots = [slot for slot in self._slots if slot is not None]
        total = sum(count for _, _, count in slots)
        mean = torch.stack([s.to(device) for s, _, _ in slots]).sum(0) / total
        var = (torch.stack([ss.to(device) for _, ss, _ in slots]).sum(0) / total - mean * mean).clamp(min=0)
        return mean, var, total

    def abort(self) -> None:
        """Release every replica waiting here (they raise); used when a sibling has failed."""
        self._barrier.abort()

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(
                "a DataParallel replica did not reach synchronised BatchNorm (it failed or timed out)"
            ) from None


class ReplicaSyncBatchNorm(_SyncedBatchNormBase):
    """BatchNorm whose replicas under `DataParallelWithSyncBN` share batch statistics.

    Outside DataParallel (one device, eval mode) it is plain BatchNorm.
    """

    _replica_sync: _ReplicaSync | None = None
    _replica_id: int = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        sync = self._replica_sync
        if sync is None or not self.training:
            return super().forward(input)
        factor = self._momentum() if self.track_running_stats else 0.0
        s, ss, count = _local_stats(input)
        mean, var, total = sync.exchange(self._replica_id, s, ss, count)
        invstd = torch.rsqrt(var + self.eps)
        if self._replica_id == 0 and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), float(total), factor)
        return _normalize(input, mean.to(input.dtype), invstd.to(input.dtype), self.weight, self.bias)


def attach_replica_sync(replicas: Sequence[nn.Module]) -> list[_ReplicaSync]:
    """Give the i-th ReplicaSyncBatchNorm of every replica one shared `_ReplicaSync`.

    Called by `DataParallelWithSyncBN.replicate` on every forward (replicas are rebuilt each
    time); the attributes land on the replicas only, never on the wrapped module.
    """
    layers = [[m for m in r.modules() if isinstance(m, ReplicaSyncBatchNorm)] for r in replicas]
    syncs = []
    for same_layer in zip(*layers, strict=True):
        sync = _ReplicaSync(len(same_layer))
        syncs.append(sync)
        for replica_id, module in enumerate(same_layer):
            module._replica_sync = sync
            module._replica_id = replica_id
    return syncs


def guard_replicas(
    replicas: Sequence[Callable[..., Any]], syncs: Sequence[_ReplicaSync]
) -> list[Callable[..., Any]]:
    """Wrap each replica so that if it fails, the others stop waiting for it at once.

    Without this a replica that raises (out of memory, say) before reaching a BatchNorm leaves
    its siblings blocked in the exchange until the barrier's timeout.
    """

    def guarded(replica: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return replica(*args, **kwargs)
            except BaseException:
                for sync in syncs:
                    sync.abort()
                raise

        return run

    return [guarded(r) for r in replicas]


class DataParallelWithSyncBN(nn.DataParallel):
    """nn.DataParallel whose replicas synchronise their ReplicaSyncBatchNorm layers (the seed's
    DataParallelWithCallback, reduced to what BatchNorm needs)."""

    _syncs: list[_ReplicaSync] = []  # those of the forward in progress (forward is not reentrant)

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        self._syncs = attach_replica_sync(replicas)
        return replicas

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        return super().parallel_apply(guard_replicas(replicas, self._syncs), inputs, kwargs)


# --------------------------------------------------------------------------------------------
# conversion


def _convert(module: nn.Module, make: Callable[[_BatchNorm], _BatchNorm]) -> nn.Module:
    """Replace every plain BatchNorm layer, sharing its parameters and buffers (so weights already
    loaded, and any optimizer built later, see the same tensors)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, _SyncedBatchNormBase | nn.SyncBatchNorm):
        new = make(module)
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, _convert(child, make))
    return module


def _bn_args(bn: _BatchNorm) -> dict[str, Any]:
    return {
        "num_features": bn.num_features,
        "eps": bn.eps,
        "momentum": bn.momentum,
        "affine": bn.affine,
        "track_running_stats": bn.track_running_stats,
    }


def convert_distributed_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Like `nn.SyncBatchNorm.convert_sync_batchnorm`, for CPU modules. Call before the DDP wrap."""
    return _convert(module, lambda bn: DistributedBatchNorm(**_bn_args(bn), process_group=process_group))


def convert_replica_batchnorm(module: nn.Module) -> nn.Module:
    """The seed's `convert_model`: BatchNorm layers that sync under `DataParallelWithSyncBN`."""
    return _convert(module, lambda bn: ReplicaSyncBatchNorm(**_bn_args(bn)))
