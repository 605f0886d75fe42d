"""Process-group lifecycle and the few collectives the trainer needs.

Helpers work whether or not a process group exists (single and dp run without one), the way
torchvision's reference `utils.py` does, so the trainer has one code path for every mode.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from workers.runtime import process_groups
from workers.runtime.trainer.plan import RunPlan

# How much training may pass between two exchanges of the ranks' SIGTERM flags (StopAgreement).
STOP_EXCHANGE_S = 0.2
STOP_EXCHANGE_MAX_STEPS = 64


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """This rank's place, plus a CPU (gloo) group for small host-side collectives.

    With NCCL a host-side flag would have to travel through the GPU and synchronise the
    stream; a gloo group keeps the per-step stop agreement off the device entirely.
    """

    rank: int
    world_size: int
    device: torch.device
    cpu_group: Any = None  # None means the default group (already gloo on CPU)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(plan: RunPlan) -> DistContext:
    """Join the process group when the plan needs one; set the CUDA device first."""
    device = torch.device(plan.device)
    if plan.is_cuda:
        torch.cuda.set_device(device)
    if plan.backend is None:
        return DistContext(rank=0, world_size=1, device=device)
    dist.init_process_group(
        backend=plan.backend,
        init_method="env://",
        rank=plan.rank,
        world_size=plan.world_size,
        device_id=device if plan.backend == "nccl" else None,
    )
    cpu_group = dist.new_group(backend="gloo") if plan.backend == "nccl" else None
    return DistContext(rank=plan.rank, world_size=plan.world_size, device=device, cpu_group=cpu_group)


def describe_placement(plan: RunPlan) -> str:
    """Where this rank computes, with each GPU's UUID as `nvidia-smi -L` prints it: a job's log
    then names the physical GPU, whatever CUDA_VISIBLE_DEVICES renumbered (issue #22)."""
    backend = plan.backend or "none (one process)"
    if not plan.is_cuda:
        return f"placement: cpu, backend {backend}"
    indices = plan.dp_device_ids or (torch.device(plan.device).index or 0,)
    gpus = "; ".join(f"cuda:{i} {_gpu_identity(i)}" for i in indices)
    return f"placement: {gpus}, backend {backend}"


def _gpu_identity(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        uuid = f"GPU-{uuid}"
    return f"({props.name}{', ' + uuid if uuid else ''})"


def teardown_distributed() -> None:
    """Leave the process group, on every exit path (success, error, preemption). The groups
    themselves are kept until the rank's `os._exit` (see ../process_groups.py)."""
    process_groups.destroy()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier(group=ctx.cpu_group)


def all_reduce_sum(ctx: DistContext, tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (a no-op alone), returning the tensor for chaining."""
    if ctx.distributed:
        dist.all_reduce(tensor)
    return tensor


def gather_to_main(ctx: DistContext, obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0; None elsewhere."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0, group=ctx.cpu_group)
    return out


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (CPU and every CUDA device) alike."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def exchange_every(slowest_step_s: float) -> int:
    """Steps between two stop-flag exchanges: about `STOP_EXCHANGE_S` of the slowest rank's
    training, at least 1 and at most `STOP_EXCHANGE_MAX_STEPS`."""
    if slowest_step_s <= 0:
        return 1
    return max(1, min(STOP_EXCHANGE_MAX_STEPS, int(STOP_EXCHANGE_S / slowest_step_s)))


class StopAgreement:
    """Decides, identically on every rank, after which step to stop for a SIGTERM.

    Ranks receive the signal at slightly different steps; if each stopped on its own, one would
    wait forever in the next step's all-reduce. So the ranks exchange their flags (and their
    step times) in an asynchronous all-reduce (MAX), and each exchange's result is read at the
    next one: every rank sees the same value at the same step, and the exchange overlaps the
    training in between instead of stalling it.

    One exchange per step cost a measurable share of a small model's step on a CPU host
    (about 6% at 9 ms steps, 2 gloo ranks), so exchanges are spaced to about
    `STOP_EXCHANGE_S` of training, at the pace of the slowest rank. The spacing is computed
    from the exchanged values alone, so it is the same on every rank. A rank stops at most two
    spacings (under half a second, or one step for slow models) after the signal and saves
    where it stops: no step is lost, well inside torchrun's 30 s before SIGKILL.
    """

    def __init__(self, ctx: DistContext, clock: Callable[[], float] = time.monotonic) -> None:
        self._ctx = ctx
        self._clock = clock
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._every = 1
        self._since = 0
        self._posted_at: float | None = clock()
        self._save = False  # the last exchange's "some rank's checkpoint timer is due"

    @property
    def every(self) -> int:
        """Steps between exchanges, as agreed at the last one."""
        return self._every

    def after_step(self, local_stop: bool, local_save: bool = False) -> bool:
        """True when every rank must stop now. `local_save` (this rank's checkpoint timer is
        due) travels in the same exchange; `take_save()` then says, alike on every rank,
        whether to save at this step."""
        if not self._ctx.distributed:
            self._save = local_save
            return local_stop
        self._since += 1
        if self._since < self._every:
            return False
        agreed = self._collect()
        if not agreed:
            self._post(local_stop, local_save)
        return agreed

    def take_save(self) -> bool:
        """Whether every rank saves now (once per agreement)."""
        save, self._save = self._save, False
        return save

    def settle(self, local_stop: bool) -> bool:
        """A blocking round, for points where every rank waits anyway (an epoch's end)."""
        if not self._ctx.distributed:
            return local_stop
        if self._collect():
            return True
        self._post(local_stop)
        stop = self._collect()
        self._posted_at = None  # what follows (validation, saving) is not a training step's time
        return stop

    def _post(self, flag: bool, save: bool = False) -> None:
        now = self._clock()
        posted = self._posted_at
        step_us = int((now - posted) / self._since * 1e6) if posted is not None and self._since > 0 else 0
        tensor = torch.tensor([int(flag), int(save), step_us], dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._ctx.cpu_group, async_op=True)
        self._pending = (work, tensor)
        self._posted_at = now
        self._since = 0

    def _collect(self) -> bool:
        if self._pending is None:
            return False
        work, tensor = self._pending
        self._pending = None
        work.wait()
        stop, save, slowest_step_us = tensor.tolist()
        self._save = bool(save)
        if slowest_step_us > 0:
            self._every = exchange_every(slowest_step_us / 1e6)
        return bool(stop)
