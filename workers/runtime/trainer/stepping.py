"""One optimizer step of the builtin trainer, as the v2 hyperparameters shape it (contract §3):
the learning-rate schedule with warm-up, gradient accumulation, clipping and mixed precision.

The schedule is a pure function of the optimizer step, so a resumed job (which restores its
step) continues on exactly the same learning rates with no state of its own. Accumulation
groups never straddle an epoch: the last group of an epoch may be shorter, and its loss is
averaged over the batches it really holds.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from workers.runtime.errors import ConfigError
from workers.runtime.trainer.config import Hyperparameters

STEP_DECAYS = (0.5, 0.75)  # "step": x0.1 at each of these fractions of the optimizer steps


def lr_factor(step: int, total: int, schedule: str, warmup: int) -> float:
    """The multiplier of the base learning rate for optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "step":
        return 0.1 ** sum(progress >= edge for edge in STEP_DECAYS)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass(frozen=True)
class Grouping:
    """Which batches of an epoch make one optimizer step."""

    per_epoch: int  # batches per epoch
    accum: int

    @property
    def groups_per_epoch(self) -> int:
        return -(-self.per_epoch // self.accum)

    def is_first(self, batch: int) -> bool:
        return batch % self.accum == 0

    def is_last(self, batch: int) -> bool:
        return batch % self.accum == self.accum - 1 or batch == self.per_epoch - 1

    def size(self, batch: int) -> int:
        start = batch - batch % self.accum
        return min(self.accum, self.per_epoch - start)

    def optimizer_step(self, epoch: int, batch: int) -> int:
        """The 0-based optimizer step that batch `batch` of epoch `epoch` contributes to."""
        return epoch * self.groups_per_epoch + batch // self.accum


class Stepper:
    """Runs micro-batches and optimizer steps for the trainer; `scaler` holds fp16's state."""

    def __init__(self, optimizer: torch.optim.Optimizer, hp: Hyperparameters, device: torch.device) -> None:
        if hp.amp == "fp16" and device.type != "cuda":
            raise ConfigError("amp: fp16 needs a CUDA worker; on the CPU use bf16")
        self.optimizer, self.hp, self.device = optimizer, hp, device
        self.base_lrs = [hp.lr for _ in optimizer.param_groups]
        self.scaler = torch.amp.GradScaler("cuda") if hp.amp == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.hp.amp is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.hp.amp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor, group_size: int) -> None:
        scaled = loss / group_size if group_size > 1 else loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()

    def step(self, params: Callable[[], Iterator[torch.nn.Parameter]], opt_step: int, total: int) -> None:
        factor = lr_factor(opt_step, total, self.hp.lr_schedule, self.hp.warmup_steps)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        if self.scaler is not None and self.hp.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
        if self.hp.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params(), self.hp.clip_grad_norm, foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def state(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state(self, state: Any) -> None:
        if self.scaler is not None and isinstance(state, dict) and state:
            self.scaler.load_state_dict(state)
