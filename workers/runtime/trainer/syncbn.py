"""Synchronised BatchNorm where PyTorch's own does not reach.

Two cases, both computing batch statistics over the *global* batch so that N small per-device
batches normalise exactly like one big one:

* `DistributedBatchNorm` — DDP on CPU. `nn.SyncBatchNorm` refuses CPU modules (its kernels are
  CUDA-only), so this autograd.Function all-gathers every rank's per-channel count, mean and M2
  in forward, and all-reduces the two gradient sums in backward. On CUDA the trainer uses the
  native one.
* `ReplicaSyncBatchNorm` + `DataParallelWithSyncBN` — DataParallel, which the seed converts with
  `convert_model`. Replicas run in threads of one process, so torch.distributed cannot help; the
  replicas of one layer meet in a per-forward `_ReplicaSync`, where replica 0 merges everyone's
  statistics. The exchange is built from differentiable tensor ops, so autograd carries the
  gradient back across replicas by itself, with no barrier in backward (which on CPU, where the
  whole backward runs on one thread, would deadlock).

Statistics are exchanged as (count, mean, M2) per replica, never as sums of x and x²: with
features far from zero relative to their spread (a mean of 1e3 and a std of 0.01),
E[x²] - E[x]² cancels every significant digit of float32 and the layer normalised by a variance
off by orders of magnitude. Each replica computes its moments about one of its own values (the
shifted-data algorithm: the subtraction is exact near the mean), the replicas' moments are
merged in float64 with Chan's parallel formula (`merge_moments`, the combination
`batch_norm_gather_stats_with_counts` makes), and the input is centred on the mean split into
its float32 value and the rest, so that the rounding of a mean of 1e3 (3e-5, times invstd) does
not reach the output either. Both layers share `_local_moments`, `merge_moments` and
`_normalize`; the DataParallel one cannot run on this project's CPU machines inside real
DataParallel (that needs several GPUs), but its arithmetic and its exchange run in the CPU tests
with replicas in threads, as DataParallel runs them.

Under autocast (fp16 or bf16 activations, float32 parameters) both compute as native BatchNorm
does: statistics, normalisation and the weight and bias gradient sums in float32 (`_compute`),
the output and the input gradient rounded once to the activations' dtype, and the parameter
gradients in the parameters' dtype.

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
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _local_moments(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(count, mean, M2) per channel of this replica's batch, mean and M2 in float64.

    The sums are taken of `x - shift`, shift being the channel's first value (the shifted-data
    algorithm; a constant to autograd): that subtraction is exact for values near the mean, so
    the deviations keep their digits, and sum d² - n mean_d² loses only as many as the shift
    lies standard deviations from the mean. (`torch.var_mean` would do as well, but over dims
    (0, 2, ...) on CPU it costs five times these passes.) Differentiable, for the DataParallel
    exchange.
    """
    channels = x.size(1)
    count = x.numel() // channels if channels else 0
    if count == 0:
        zeros = x.new_zeros(channels, dtype=torch.float64)
        return 0, zeros, zeros
    xf = _compute(x)
    dims = _reduce_dims(x)
    first: tuple[int | slice, ...] = (0, slice(None), *([0] * (x.dim() - 2)))
    shift = xf.detach()[first]
    d = xf - _channel_view(shift, xf)
    sums = torch.stack([d.sum(dims), (d * d).sum(dims)]).double()
    mean_d = sums[0] / count
    m2 = (sums[1] - count * mean_d * mean_d).clamp(min=0.0)
    return count, shift.double() + mean_d, m2


def merge_moments(
    counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total count, mean, biased variance) of the union of R replicas' batches.

    `counts` is (R,), `means` and `m2s` are (R, C), all float64. Chan's parallel formula, folded
    over every replica at once: M2 = sum M2_i + sum n_i (mean_i - mean)^2, which adds only
    non-negative terms (E[x²] - E[x]² subtracts two nearly equal ones).
    """
    total = counts.sum()
    mean = (counts @ means) / total
    m2 = m2s.sum(0) + counts @ (means - mean).square()
    return total, mean, m2 / total


def _split_mean(mean: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 mean as (its value in `dtype`, the float64 remainder)."""
    head = mean.to(dtype)
    return head, mean - head.double()


def _normalize(
    x: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """(x - mean) * invstd * weight + bias for float64 statistics; the part of the mean that x's
    dtype cannot hold is folded into the per-channel shift, which costs no extra pass."""
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight.double()
    xc = _compute(x)
    head, rest = _split_mean(mean, xc.dtype)
    shift = -rest * scale if bias is None else bias.double() - rest * scale
    centred = xc - _channel_view(head, xc)  # exact near the mean
    scale, shift = _channel_view(scale.to(xc.dtype), xc), _channel_view(shift.to(xc.dtype), xc)
    if torch.is_grad_enabled():  # the DataParallel exchange: autograd needs `centred` intact
        return (centred * scale + shift).to(x.dtype)
    return centred.mul_(scale).add_(shift).to(x.dtype)


def _compute(t: torch.Tensor) -> torch.Tensor:
    """`t` in the dtype BatchNorm computes in: float32 for fp16/bf16 (autocast's activations),
    as native BatchNorm does. In fp16, a gradient sum past 65504 (an unscaled bias gradient of
    2.6 under GradScaler's 65536) is `inf`, and bf16's 8 bits of mantissa make every sum of a
    batch wrong in its third digit; only the result is rounded to the input's dtype, once."""
    return t.float() if t.dtype in _LOW_PRECISION else t


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
        count, mean, m2 = _local_moments(x)
        channels = x.size(1)
        local = torch.cat([mean.new_tensor([float(count)]), mean, m2])
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        stats = torch.stack(gathered)
        total, mean, var = merge_moments(stats[:, 0], stats[:, 1 : 1 + channels], stats[:, 1 + channels :])
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.group = group
        ctx.mark_non_differentiable(mean, var, total)
        return _normalize(x, mean, var, eps, weight, bias), mean, var, total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        x, weight, mean, invstd, total = ctx.saved_tensors
        dims = _reduce_dims(x)
        xf, dy = _compute(x), _compute(grad_out)
        # x - mean = (x - head) - rest: the first part is exact, the second a per-channel constant
        head, rest = _split_mean(mean, xf.dtype)
        x_head = xf - _channel_view(head, xf)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * x_head).sum(dims) - rest.to(sum_dy.dtype) * sum_dy
        invstd32 = invstd.to(sum_dy.dtype)
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd32).to(weight.dtype)
        grad_bias = (
            sum_dy.to(weight.dtype if weight is not None else x.dtype) if ctx.needs_input_grad[2] else None
        )
        grad_input = None
        if ctx.needs_input_grad[0]:
            # The loss of every rank depends on this rank's input through the shared statistics.
            sums = torch.cat([sum_dy, sum_dy_xmu]).double()
            dist.all_reduce(sums, group=ctx.group)
            grad_input = _grad_input(dy, x_head, rest, invstd, weight, sums, total).to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None


def _grad_input(
    grad_out: torch.Tensor,
    x_head: torch.Tensor,
    rest: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    sums: torch.Tensor,
    total: torch.Tensor,
) -> torch.Tensor:
    """BatchNorm's input gradient, scale * (dy - mean(dy) - xmu * invstd² * mean(dy * xmu)),
    with xmu = x_head - rest, as grad_out * a + x_head * b + c (a, b, c per channel)."""
    channels = invstd.numel()
    mean_dy = sums[:channels] / total
    k = invstd * invstd * sums[channels:] / total
    scale = invstd if weight is None else invstd * weight.double()
    a = _channel_view(scale.to(grad_out.dtype), grad_out)
    b = _channel_view((-k * scale).to(x_head.dtype), x_head)
    c = _channel_view(((rest * k - mean_dy) * scale).to(grad_out.dtype), grad_out)
    return (grad_out * a).add_(x_head * b).add_(c)


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


class SiblingReplicaFailed(RuntimeError):
    """Raised in a replica that was waiting for a sibling which failed or timed out: a knock-on
    error, never the root cause (see `apply_replicas`)."""


_Moments = tuple[int, torch.Tensor, torch.Tensor]


class _ReplicaSync:
    """Where the replicas of one BatchNorm layer meet during one DataParallel forward."""

    def __init__(self, replicas: int) -> None:
        self._barrier = threading.Barrier(replicas, timeout=REPLICA_TIMEOUT_S)
        self._slots: list[_Moments | None] = [None] * replicas
        self._result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def exchange(
        self, replica: int, count: int, mean: torch.Tensor, m2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global (mean, biased var, count), on this replica's device and differentiable.

        Two barrier waits: the first until every replica has posted, the second until replica 0
        has combined them, which also keeps a reused layer from overwriting slots still read.
        """
        self._slots[replica] = (count, mean, m2)
        self._wait()
        if replica == 0:
            try:
                self._result = self._combine(mean.device)
            except BaseException:
                self.abort()
                raise
        self._wait()
        assert self._result is not None
        total, mean, var = self._result
        return mean.to(m2.device), var.to(m2.device), total

    def _combine(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slots = [slot for slot in self._slots if slot is not None]
        counts = torch.tensor([float(n) for n, _, _ in slots], dtype=torch.float64, device=device)
        means = torch.stack([mean.to(device) for _, mean, _ in slots])
        m2s = torch.stack([m2.to(device) for _, _, m2 in slots])
        return merge_moments(counts, means, m2s)

    def abort(self) -> None:
        """Release every replica waiting here (they raise); used when a sibling has failed."""
        self._barrier.abort()

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise SiblingReplicaFailed(
                "a DataParallel replica did not reach synchronised BatchNorm (it failed or timed out)"
            ) from None


class ReplicaSyncBatchNorm(_SyncedBatchNormBase):
    """BatchNorm whose replicas under `DataParallelWithSyncBN` share batch statistics.

    Outside DataParallel (one device, eval mode) it is plain BatchNorm. Needs CUDA devices inside
    real DataParallel; it shares its statistics code with `DistributedBatchNorm`, and the CPU
    tests run its exchange with replicas in threads.
    """

    _replica_sync: _ReplicaSync | None = None
    _replica_id: int = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        sync = self._replica_sync
        if sync is None or not self.training:
            return super().forward(input)
        factor = self._momentum() if self.track_running_stats else 0.0
        mean, var, total = sync.exchange(self._replica_id, *_local_moments(input))
        if self._replica_id == 0 and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), float(total), factor)
        return _normalize(input, mean, var, self.eps, self.weight, self.bias)


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


class _FirstFailure:
    """The first replica of a forward to fail on its own (not as a sibling's knock-on)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.replica: int | None = None
        self.error: BaseException | None = None

    def record(self, replica: int, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.replica, self.error = replica, error


def guard_replicas(
    replicas: Sequence[Callable[..., Any]],
    syncs: Sequence[_ReplicaSync],
    failures: _FirstFailure | None = None,
) -> list[Callable[..., Any]]:
    """Wrap each replica so that if it fails, the others stop waiting for it at once.

    Without this a replica that raises (out of memory, say) before reaching a BatchNorm leaves
    its siblings blocked in the exchange until the barrier's timeout. The failure is recorded
    in `failures`, so that `apply_replicas` can name it instead of a sibling's knock-on error.
    """

    def guarded(replica_id: int, replica: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return replica(*args, **kwargs)
            except BaseException as exc:
                if failures is not None and not isinstance(exc, SiblingReplicaFailed):
                    failures.record(replica_id, exc)
                for sync in syncs:
                    sync.abort()
                raise

        return run

    return [guarded(i, r) for i, r in enumerate(replicas)]


def apply_replicas(
    apply: Callable[[Sequence[Callable[..., Any]], Sequence[Any], Any], list[Any]],
    replicas: Sequence[Callable[..., Any]],
    syncs: Sequence[_ReplicaSync],
    inputs: Sequence[Any],
    kwargs: Any,
) -> list[Any]:
    """`apply` (DataParallel's parallel_apply) over guarded replicas, raising the root cause.

    parallel_apply re-raises the first failed replica in index order; when replica 1 runs out
    of memory, that is replica 0's "did not reach synchronised BatchNorm", which hides the
    reason and, with it, the OOM that the platform's failure classification looks for in the
    error. So the replica that failed first on its own is re-raised as it was raised (type,
    message, traceback), with a note naming it; a sibling's knock-on error is never the one
    that surfaces when a root cause is known.
    """
    failures = _FirstFailure()
    try:
        return apply(guard_replicas(replicas, syncs, failures), inputs, kwargs)
    except Exception:
        root = failures.error
        if root is None:
            raise
        root.add_note(f"raised in DataParallel replica {failures.replica}; its sibling replicas were stopped")
        raise root from None


class DataParallelWithSyncBN(nn.DataParallel):
    """nn.DataParallel whose replicas synchronise their ReplicaSyncBatchNorm layers (the seed's
    DataParallelWithCallback, reduced to what BatchNorm needs)."""

    _syncs: list[_ReplicaSync] = []  # those of the forward in progress (forward is not reentrant)

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        self._syncs = attach_replica_sync(replicas)
        return replicas

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        return apply_replicas(super().parallel_apply, replicas, self._syncs, inputs, kwargs)


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
