"""config.json, parsed into keyword-only frozen dataclasses validated on construction.

The worker writes the file (contract §3's entrypoint and hyperparameters plus the mode); missing
hyperparameters take the defaults below, unknown ones are an error, since the platform has
already refused unknown fields and a stray key here means a bug, not a wish.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.runtime.env import ACCELERATORS
from workers.runtime.errors import ConfigError

MODES = ("single", "dp", "ddp", "fsdp")
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "step", "cosine")
AMP_MODES = (None, "bf16", "fp16")
ENTRYPOINT_KINDS = ("builtin", "factory")
BUILTIN_MODELS = ("cnn", "mlp")
BUILTIN_DATASETS = ("digits", "synthetic")


def _require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"hyperparameters.{name} must be an integer >= {minimum}, not {value!r}")


def _require_number(name: str, value: Any, minimum: float, *, inclusive: bool) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and (value >= minimum if inclusive else value > minimum)
    if not ok:
        bound = ">=" if inclusive else ">"
        raise ConfigError(f"hyperparameters.{name} must be a number {bound} {minimum}, not {value!r}")


@dataclass(frozen=True, kw_only=True)
class Hyperparameters:
    """Training knobs of builtin and factory jobs (batch_size is per process)."""

    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.001
    weight_decay: float = 0.001
    optimizer: str = "adamw"
    seed: int = 0
    num_workers: int = 2
    checkpoint_every: int = 1
    synthetic_size: int = 4096
    report_every: int = 10
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    amp: str | None = None
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    compile: bool = False
    checkpoint_every_s: float | None = None
    sync_buffers: str = "init"  # ddp: rank 0's buffers once ("init") or before every step ("step")
    find_unused_parameters: bool = False  # ddp's own knobs, for factory models
    static_graph: bool = False
    global_batch_size: int | None = None  # kept across world sizes (an elastic job's resizes, §12)

    def __post_init__(self) -> None:
        for name, minimum in (
            ("epochs", 1),
            ("batch_size", 1),
            ("seed", 0),
            ("num_workers", 0),
            ("checkpoint_every", 1),
            ("synthetic_size", 1),
            ("report_every", 1),
            ("warmup_steps", 0),
            ("grad_accum_steps", 1),
        ):
            _require_int(name, getattr(self, name), minimum)
        self._check_v2()
        _require_number("lr", self.lr, 0.0, inclusive=False)
        _require_number("weight_decay", self.weight_decay, 0.0, inclusive=True)
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"hyperparameters.optimizer must be one of {OPTIMIZERS}, not {self.optimizer!r}"
            )

    def _check_v2(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(
                f"hyperparameters.lr_schedule must be one of {LR_SCHEDULES}, not {self.lr_schedule!r}"
            )
        if self.amp not in AMP_MODES:
            raise ConfigError(f"hyperparameters.amp must be one of {AMP_MODES}, not {self.amp!r}")
        for name in ("clip_grad_norm", "checkpoint_every_s"):
            if getattr(self, name) is not None:
                _require_number(name, getattr(self, name), 0.0, inclusive=False)
        for name in ("compile", "find_unused_parameters", "static_graph"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"hyperparameters.{name} must be true or false, not {getattr(self, name)!r}"
                )
        if self.global_batch_size is not None:
            _require_int("global_batch_size", self.global_batch_size, 1)
        if self.sync_buffers not in ("init", "step"):
            raise ConfigError(f"hyperparameters.sync_buffers must be init or step, not {self.sync_buffers!r}")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> Hyperparameters:
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown hyperparameters {unknown}; known: {sorted(known)}")
        return cls(**raw)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def for_world(self, world_size: int) -> Hyperparameters:
        """With `global_batch_size`, the per-rank batch and accumulation that keep it on this
        many ranks (contract §12: an elastic job resized keeps its global batch): the fewest
        accumulation steps whose micro-batch is at most `batch_size`. Without it, unchanged."""
        total = self.global_batch_size
        if total is None:
            return self
        if total % world_size:
            raise ConfigError(
                f"hyperparameters.global_batch_size {total} does not divide over {world_size} ranks"
            )
        per_rank = total // world_size
        cap = self.batch_size
        fitting = (a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= cap)
        accum = next(fitting)
        return dataclasses.replace(self, batch_size=per_rank // accum, grad_accum_steps=accum)


@dataclass(frozen=True, kw_only=True)
class Entrypoint:
    """What to train: builtin names, or "module:callable" strings for factories."""

    kind: str
    model: str
    dataset: str

    def __post_init__(self) -> None:
        if self.kind not in ENTRYPOINT_KINDS:
            raise ConfigError(f"entrypoint.kind must be one of {ENTRYPOINT_KINDS}, not {self.kind!r}")
        if self.kind == "builtin":
            if self.model not in BUILTIN_MODELS:
                raise ConfigError(f"unknown builtin model {self.model!r}; known: {BUILTIN_MODELS}")
            if self.dataset not in BUILTIN_DATASETS:
                raise ConfigError(f"unknown builtin dataset {self.dataset!r}; known: {BUILTIN_DATASETS}")
            return
        for role, spec in (("model", self.model), ("dataset", self.dataset)):
            if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
                raise ConfigError(f"entrypoint.{role} must look like 'package.module:callable', not {spec!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The whole of config.json."""

    mode: str
    entrypoint: Entrypoint
    hyperparameters: Hyperparameters = field(default_factory=Hyperparameters)
    accelerator: str | None = None
    gpus_per_node: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.accelerator is not None and self.accelerator not in ACCELERATORS:
            raise ConfigError(f"accelerator must be one of {ACCELERATORS}, not {self.accelerator!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int):
            raise ConfigError(f"gpus_per_node must be an integer, not {self.gpus_per_node!r}")
        if self.gpus_per_node < 1 or (self.mode == "single" and self.gpus_per_node != 1):
            raise ConfigError(f"gpus_per_node={self.gpus_per_node} does not fit mode {self.mode!r}")


def parse_config(raw: Any) -> TrainConfig:
    """Validate a decoded config.json."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config must be a JSON object")
    unknown = sorted(set(raw) - {"mode", "accelerator", "gpus_per_node", "entrypoint", "hyperparameters"})
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}")
    entry = raw.get("entrypoint")
    if not isinstance(entry, Mapping) or set(entry) != {"kind", "model", "dataset"}:
        raise ConfigError(f"entrypoint must be an object with kind, model and dataset, not {entry!r}")
    hyper = raw.get("hyperparameters")
    if hyper is not None and not isinstance(hyper, Mapping):
        raise ConfigError("hyperparameters must be an object")
    return TrainConfig(
        mode=raw.get("mode"),  # type: ignore[arg-type]  # validated in __post_init__
        accelerator=raw.get("accelerator"),
        gpus_per_node=raw.get("gpus_per_node", 1),
        entrypoint=Entrypoint(**entry),
        hyperparameters=Hyperparameters.from_mapping(hyper),
    )


def load_config(path: Path) -> TrainConfig:
    """Read and validate config.json."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config {path} is not valid JSON: {exc}") from exc
    return parse_config(raw)
