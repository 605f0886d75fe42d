"""The job spec of contract §3, with every limit declared so the OpenAPI schema shows it.

Context-free contradictions (a `dp` job on 2 nodes, `single` on 2 GPUs) are caught here and
name their field. Checks that need the cluster or the settings (does any worker fit, is the
script inside the roots, is the checkpoint the caller's) live in `service.jobs.validation`.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from service.schemas import MAX_ID, require_storable

NAME = Annotated[str, Field(min_length=1, max_length=128)]
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
FORBIDDEN_ENV = {
    "RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "PYTHONEXECUTABLE",
    "PATH",
    "HOME",
    "BASH_ENV",
    "ENV",
    "NVIDIA_VISIBLE_DEVICES",
}
FORBIDDEN_ENV_PREFIXES = ("MASTER_", "LOCAL_", "TORCHJOBS_", "TORCHELASTIC_", "LD_", "DYLD_", "GROUP_")
CALLABLE_RE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class Input(BaseModel):
    """Strict: `true` is not a priority and "3" is not a GPU count. Every field, nested maps
    included, refuses what the database cannot store (a NUL, a lone surrogate)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _storable(cls, v: object) -> object:
        return require_storable(v)


class BuiltinEntrypoint(Input):
    kind: Literal["builtin"]
    model: Literal["cnn", "mlp"] = "cnn"
    dataset: Literal["digits", "synthetic"] = "digits"


class FactoryEntrypoint(Input):
    kind: Literal["factory"]
    model: str = Field(pattern=CALLABLE_RE, max_length=256, description="module:callable -> nn.Module")
    dataset: str = Field(pattern=CALLABLE_RE, max_length=256, description="module:callable -> dataset(s)")


class ScriptEntrypoint(Input):
    kind: Literal["script"]
    path: str = Field(min_length=1, max_length=1024)
    args: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=256)

    @field_validator("path")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("path may not contain NUL")
        return v


Entrypoint = Annotated[BuiltinEntrypoint | FactoryEntrypoint | ScriptEntrypoint, Field(discriminator="kind")]


class Hyperparameters(Input):
    epochs: int = Field(10, ge=1, le=100_000)
    batch_size: int = Field(64, ge=1, le=65_536, description="per process")
    lr: float = Field(0.001, gt=0, le=10)
    weight_decay: float = Field(0.001, ge=0, le=10)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    seed: int = Field(0, ge=0, le=2**31 - 1)
    num_workers: int = Field(2, ge=0, le=64)
    checkpoint_every: int = Field(1, ge=1, le=100_000, description="epochs")
    lr_schedule: Literal["constant", "step", "cosine"] = Field(
        "constant", description="step: x0.1 at 50% and 75% of the steps; cosine: down to 0 at the end"
    )
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="linear warm-up, optimizer steps")
    amp: Literal["bf16", "fp16"] | None = Field(None, description="autocast; fp16 only on CUDA")
    grad_accum_steps: int = Field(1, ge=1, le=1024, description="batches per optimizer step")
    clip_grad_norm: float | None = Field(None, gt=0, le=1e6, description="max global gradient norm")
    compile: bool = Field(False, description="torch.compile the model")
    checkpoint_every_s: float | None = Field(
        None, gt=0, le=1e7, description="also save every this many seconds (null: by epoch only)"
    )
    synthetic_size: int = Field(4096, ge=1, le=10_000_000, description="samples of the synthetic data set")
    report_every: int = Field(10, ge=1, le=1_000_000, description="steps between progress reports")
    # ddp knobs for factory models (#37)
    sync_buffers: Literal["init", "step"] = Field(
        "init", description="non-BatchNorm buffers from rank 0: once at the start, or before every step"
    )
    find_unused_parameters: bool = Field(False, description="DDP's, for models that skip parameters")
    static_graph: bool = Field(False, description="DDP's, for a graph that never changes")
    global_batch_size: int | None = Field(
        None, ge=1, le=16_777_216, description="kept across world sizes: per-rank batch x accumulation (§12)"
    )


class ResumeFrom(Input):
    checkpoint_id: int | None = Field(None, ge=1, le=MAX_ID)
    job_id: int | None = Field(None, ge=1, le=MAX_ID)

    @model_validator(mode="after")
    def _exactly_one(self) -> ResumeFrom:
        if (self.checkpoint_id is None) == (self.job_id is None):
            raise ValueError("give exactly one of checkpoint_id or job_id")
        return self


class Dependency(Input):
    """Wait for another job of yours (contract §10): until it `succeeded`, or until it `ended`
    in any way."""

    job_id: int = Field(ge=1, le=MAX_ID)
    condition: Literal["succeeded", "ended"] = "succeeded"


def _requirement(item: str) -> str:
    """One PEP 508 requirement specifier: no options, URLs, paths or editables (contract §6)."""
    if item.lstrip().startswith("-"):
        raise ValueError(f"{item!r}: installer options are not allowed, only requirement specifiers")
    try:
        req = Requirement(item)
    except InvalidRequirement as exc:
        raise ValueError(f"{item!r} is not a PEP 508 requirement specifier ({exc})") from None
    if req.url:
        raise ValueError(f"{item!r}: URLs and paths are not allowed, only requirement specifiers")
    if canonicalize_name(req.name) in WORKER_OWN:
        raise ValueError(f"{item!r}: {req.name} is the worker's own; the ranks always run the worker's torch")
    return item.strip()


WORKER_OWN = frozenset({"torch", "torchjobs"})
PipItem = Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_requirement)]


class Environment(Input):
    pip: list[PipItem] = Field(default_factory=list, max_length=100)


GRID_PATH_RE = r"^[a-z_][a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
GridPath = Annotated[str, Field(pattern=GRID_PATH_RE, max_length=128)]
MAX_SWEEP_POINTS = 1000


METRIC_NAME = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f]+$")]


class Objective(Input):
    """What a sweep compares its children by (contract §13): the last value of one series."""

    metric: METRIC_NAME
    mode: Literal["min", "max"]


class EarlyStop(Input):
    """ASHA (contract §13): rungs at min_epochs * reduction_factor**k epochs."""

    kind: Literal["asha"]
    min_epochs: int = Field(ge=1, le=100_000)
    reduction_factor: int = Field(ge=2, le=100)


class Sweep(Input):
    """A grid over spec fields (contract §10): one child job per point, each validated as if
    it had been submitted alone (`service.jobs.sweeps`)."""

    grid: dict[GridPath, Annotated[list[Any], Field(min_length=1, max_length=MAX_SWEEP_POINTS)]] = Field(
        min_length=1,
        max_length=16,
        description='dotted spec paths to values: {"hyperparameters.lr": [0.1, 0.01]}',
    )
    max_parallel: int | None = Field(None, ge=1, le=MAX_SWEEP_POINTS, description="children running at once")
    objective: Objective | None = None
    early_stop: EarlyStop | None = None

    @field_validator("early_stop")
    @classmethod
    def _early_stop_needs_objective(cls, v: EarlyStop | None, info: ValidationInfo) -> EarlyStop | None:
        if v is not None and info.data.get("objective") is None and "objective" in info.data:
            raise ValueError("early_stop needs an objective: the metric its rungs compare")
        return v

    @field_validator("grid")
    @classmethod
    def _paths_and_size(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        paths = sorted(v)
        for path in paths:
            if path.split(".")[0] == "sweep":
                raise ValueError(f"{path!r}: a sweep cannot vary its own sweep")
        for a, b in zip(paths, paths[1:], strict=False):
            if b.startswith(a + "."):
                raise ValueError(f"{a!r} and {b!r} overlap: give one of them")
        points = math.prod(len(values) for values in v.values())
        if points > MAX_SWEEP_POINTS:
            raise ValueError(f"the grid has {points} points; at most {MAX_SWEEP_POINTS}")
        return v


class NodeRange(Input):
    """An elastic job's node count (contract §12): starts on as many as fit from `min` to `max`."""

    min: int = Field(ge=1, le=64)
    max: int = Field(ge=1, le=64)

    @model_validator(mode="after")
    def _ordered(self) -> NodeRange:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self


class JobSpec(Input):
    name: NAME | None = None
    mode: Literal["single", "dp", "ddp", "fsdp"]
    nodes: Annotated[int, Field(ge=1, le=64)] | NodeRange = Field(1, union_mode="left_to_right")
    gpus_per_node: int = Field(1, ge=1, le=64)
    entrypoint: Entrypoint
    hyperparameters: Hyperparameters | None = None
    resume_from: ResumeFrom | None = None
    max_retries: int = Field(0, ge=0, le=10)
    keep_checkpoints: int | None = Field(
        None, ge=1, le=1_000_000, description="keeps the job's newest N checkpoints (null: all; contract §11)"
    )
    max_duration_s: int | None = Field(
        None, ge=1, le=10**8, description="seconds over all attempts, then checkpoint and fail (null: none)"
    )
    stall_timeout_s: int | None = Field(
        600,
        ge=1,
        le=10**7,
        description="seconds with no log, event or checkpoint from any rank (null: off)",
    )
    priority: int = Field(0, ge=-1000, le=1000)
    preemptible: bool = Field(True, description="a job of higher priority may stop it (contract §12)")
    stop_grace_s: int = Field(
        120, ge=1, le=86400, description="seconds between SIGTERM and SIGKILL when it is preempted"
    )
    env: dict[str, Annotated[str, Field(max_length=4096)]] = Field(default_factory=dict, max_length=64)
    labels: dict[str, Annotated[str, Field(max_length=256)]] = Field(default_factory=dict, max_length=32)
    code: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="an uploaded Code id")
    environment: Environment | None = None
    depends_on: list[Dependency] = Field(default_factory=list, max_length=32)
    sweep: Sweep | None = None

    @field_validator("nodes")
    @classmethod
    def _nodes_fit_mode(cls, v: int | NodeRange, info: ValidationInfo) -> int | NodeRange:
        mode = info.data.get("mode")
        if isinstance(v, NodeRange) and mode in ("single", "dp"):
            raise ValueError(f"mode {mode!r} runs on one node; only 'ddp' and 'fsdp' may be elastic")
        if isinstance(v, int) and v > 1 and mode in ("single", "dp"):
            raise ValueError(f"mode {mode!r} runs on one node; only 'ddp' and 'fsdp' may use nodes > 1")
        return v

    @property
    def node_range(self) -> tuple[int, int]:
        """(fewest, most) nodes: equal for a job of a fixed size."""
        if isinstance(self.nodes, NodeRange):
            return self.nodes.min, self.nodes.max
        return self.nodes, self.nodes

    @field_validator("hyperparameters")
    @classmethod
    def _global_batch_divides(cls, v: Hyperparameters | None, info: ValidationInfo) -> Hyperparameters | None:
        """Every world size the job may run at takes an equal share of the global batch."""
        nodes, gpus = info.data.get("nodes"), info.data.get("gpus_per_node")
        if v is None or v.global_batch_size is None or info.data.get("mode") not in ("ddp", "fsdp"):
            return v
        if nodes is None or gpus is None:
            return v
        low, high = (nodes.min, nodes.max) if isinstance(nodes, NodeRange) else (nodes, nodes)
        for n in range(low, high + 1):
            if v.global_batch_size % (n * gpus):
                raise ValueError(
                    f"global_batch_size {v.global_batch_size} does not divide over {n * gpus} ranks "
                    f"({n} nodes x {gpus} GPUs)"
                )
        return v

    @field_validator("gpus_per_node")
    @classmethod
    def _gpus_fit_mode(cls, v: int, info: ValidationInfo) -> int:
        if v != 1 and info.data.get("mode") == "single":
            raise ValueError("mode 'single' uses exactly 1 GPU")
        return v

    @field_validator("env")
    @classmethod
    def _env_is_safe(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not ENV_KEY_RE.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if key.upper() in FORBIDDEN_ENV or key.upper().startswith(FORBIDDEN_ENV_PREFIXES):
                raise ValueError(f"{key!r} is set by torchjobs or the loader and may not be overridden")
            if "\x00" in value:
                raise ValueError(f"value of {key!r} may not contain NUL")
        return v

    @field_validator("depends_on")
    @classmethod
    def _each_job_once(cls, v: list[Dependency]) -> list[Dependency]:
        ids = [d.job_id for d in v]
        if len(ids) != len(set(ids)):
            raise ValueError("each job may appear once in depends_on")
        return v

    @field_validator("labels")
    @classmethod
    def _label_keys(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not 1 <= len(key) <= 63:
                raise ValueError("label keys are 1 to 63 characters")
        return v

    @field_validator("hyperparameters")
    @classmethod
    def _hyperparameters_need_trainer(
        cls, v: Hyperparameters | None, info: ValidationInfo
    ) -> Hyperparameters | None:
        entry = info.data.get("entrypoint")
        if v is not None and isinstance(entry, ScriptEntrypoint):
            raise ValueError("script entrypoints take their own args, not hyperparameters")
        return v

    def effective_hyperparameters(self) -> Hyperparameters | None:
        if isinstance(self.entrypoint, ScriptEntrypoint):
            return None
        return self.hyperparameters or Hyperparameters()
