"""The rank's environment, read once into a frozen dataclass.

Everything the platform and torchrun tell a rank arrives as environment variables (contract §4).
Reading them in one place, once, keeps the rest of the runtime pure: functions take a
`RuntimeEnv`, and tests build one directly instead of patching `os.environ`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from workers.runtime.errors import ConfigError

ACCELERATORS = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class RuntimeEnv:
    """torchrun's rank variables plus the TORCHJOBS_* ones; defaults describe a lone process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None
    attempt: int | None = None
    checkpoint_dir: Path | None = None
    resume_from: Path | None = None
    events_path: Path | None = None
    accelerator: str | None = None
    node_rank: int | None = None  # torchrun's GROUP_RANK
    preflight_timeout_s: float = 60.0
    # torchrun (its elastic agent) started this process: TORCHELASTIC_RUN_ID is set.
    under_torchrun: bool = False
    # CPU workers: this node's slots of the worker (TORCHJOBS_SLOTS) and how many it has in all
    # (TORCHJOBS_WORKER_SLOTS); a rank takes its slots' share of the cores (see cpus.py).
    slots: tuple[int, ...] | None = None
    worker_slots: int | None = None
    # MIG (mig.py): this process sees only its own instance, as cuda:0, whatever its LOCAL_RANK
    own_device: bool = False
    # Test-only: when set, each rank dumps the sample indices it trained on and its BatchNorm
    # buffers after every epoch (see workers.runtime.trainer.debug).
    debug_dump_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(
                f"LOCAL_RANK={self.local_rank} is outside LOCAL_WORLD_SIZE={self.local_world_size}"
            )
        if self.accelerator is not None and self.accelerator not in ACCELERATORS:
            raise ConfigError(f"TORCHJOBS_ACCELERATOR must be cpu or cuda, not {self.accelerator!r}")
        if self.slots is not None and (not self.slots or min(self.slots) < 0):
            raise ConfigError(f"TORCHJOBS_SLOTS must list slot numbers, not {self.slots!r}")
        if self.worker_slots is not None and self.worker_slots < 1:
            raise ConfigError(f"TORCHJOBS_WORKER_SLOTS must be at least 1, not {self.worker_slots}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RuntimeEnv:
        """Build from a mapping shaped like `os.environ`; empty values count as unset."""
        env = _Variables(environ)
        world_size = env.integer("WORLD_SIZE") or 1
        return cls(
            rank=env.integer("RANK") or 0,
            local_rank=env.integer("LOCAL_RANK") or 0,
            world_size=world_size,
            local_world_size=env.integer("LOCAL_WORLD_SIZE") or world_size,
            master_addr=env.text("MASTER_ADDR"),
            master_port=env.integer("MASTER_PORT"),
            job_id=env.text("TORCHJOBS_JOB_ID"),
            attempt=env.integer("TORCHJOBS_ATTEMPT"),
            checkpoint_dir=env.path("TORCHJOBS_CHECKPOINT_DIR"),
            resume_from=env.path("TORCHJOBS_RESUME_FROM"),
            events_path=env.path("TORCHJOBS_EVENTS"),
            accelerator=env.text("TORCHJOBS_ACCELERATOR"),
            node_rank=env.integer("GROUP_RANK"),
            preflight_timeout_s=env.seconds("TORCHJOBS_PREFLIGHT_TIMEOUT_S", 60.0),
            debug_dump_dir=env.path("TORCHJOBS_DEBUG_DUMP_DIR"),
            slots=env.numbers("TORCHJOBS_SLOTS"),
            worker_slots=env.integer("TORCHJOBS_WORKER_SLOTS"),
            under_torchrun=env.text("TORCHELASTIC_RUN_ID") is not None,
            own_device=env.text("TORCHJOBS_RANK_DEVICES") is not None,
        )


class _Variables:
    """Typed reads of a mapping shaped like `os.environ`; empty values count as unset."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    def text(self, name: str) -> str | None:
        value = self.environ.get(name, "").strip()
        return value or None

    def integer(self, name: str) -> int | None:
        value = self.text(name)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{name} must be an integer, not {value!r}") from None

    def seconds(self, name: str, default: float) -> float:
        value = self.text(name)
        if value is None:
            return default
        try:
            parsed = float(value)
        except ValueError:
            parsed = -1.0
        if not parsed > 0:
            raise ConfigError(f"{name} must be a positive number of seconds, not {value!r}")
        return parsed

    def path(self, name: str) -> Path | None:
        value = self.text(name)
        return Path(value) if value else None

    def numbers(self, name: str) -> tuple[int, ...] | None:
        value = self.text(name)
        if value is None:
            return None
        try:
            return tuple(int(part) for part in value.split(","))
        except ValueError:
            raise ConfigError(f"{name} must be comma-separated integers, not {value!r}") from None


@functools.cache
def runtime_env() -> RuntimeEnv:
    """The process's environment, read on first use and never again."""
    return RuntimeEnv.from_environ(os.environ)
