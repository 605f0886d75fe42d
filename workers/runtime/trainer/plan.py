"""Where and how this rank runs, computed by a pure function before anything is acted on.

As torchrun does with `config_from_args`, the decisions (device, backend, DataParallel devices,
whether a process group is needed) are made here from the config, the environment and the number
of visible GPUs, and only then carried out; so they can be unit-tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.runtime.env import RuntimeEnv
from workers.runtime.errors import ConfigError
from workers.runtime.trainer.config import TrainConfig

# Modes that run one process per GPU (or CPU slot) under torchrun, over any number of nodes.
DISTRIBUTED_MODES = ("ddp", "fsdp")


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """The resolved placement of one rank."""

    mode: str
    accelerator: str
    device: str  # "cpu" or "cuda:N"
    backend: str | None  # None: no process group (single, dp)
    rank: int
    local_rank: int
    world_size: int
    dp_device_ids: tuple[int, ...] = ()  # DataParallel over these GPUs when more than one

    @property
    def is_cuda(self) -> bool:
        return self.accelerator == "cuda"


def make_plan(config: TrainConfig, env: RuntimeEnv, *, cuda_device_count: int) -> RunPlan:
    """Resolve the accelerator (config wins over TORCHJOBS_ACCELERATOR, then auto-detect)."""
    accelerator = config.accelerator or env.accelerator or ("cuda" if cuda_device_count else "cpu")
    if accelerator == "cuda" and cuda_device_count == 0:
        raise ConfigError("accelerator is cuda but this rank sees no CUDA device")
    if config.mode in DISTRIBUTED_MODES:
        return _ddp_plan(config.mode, env, accelerator, cuda_device_count)
    if env.world_size != 1:
        raise ConfigError(f"mode {config.mode!r} runs one process, but torchrun started {env.world_size}")
    dp_ids: tuple[int, ...] = ()
    if config.mode == "dp" and accelerator == "cuda":
        if config.gpus_per_node > cuda_device_count:
            raise ConfigError(f"dp wants {config.gpus_per_node} GPUs but this node sees {cuda_device_count}")
        dp_ids = tuple(range(config.gpus_per_node))
    return RunPlan(
        mode=config.mode,
        accelerator=accelerator,
        device="cuda:0" if accelerator == "cuda" else "cpu",
        backend=None,
        rank=0,
        local_rank=0,
        world_size=1,
        dp_device_ids=dp_ids,
    )


def _ddp_plan(mode: str, env: RuntimeEnv, accelerator: str, cuda_device_count: int) -> RunPlan:
    """ddp and fsdp alike: one process per GPU (or CPU slot), all of them in one process group."""
    if env.master_addr is None or env.master_port is None:
        raise ConfigError(f"mode {mode} must be started by torchrun (MASTER_ADDR/MASTER_PORT are unset)")
    if accelerator == "cuda":
        index = 0 if env.own_device else env.local_rank  # a MIG rank sees its own instance only
        if index >= cuda_device_count:
            raise ConfigError(f"LOCAL_RANK={env.local_rank} but this node sees {cuda_device_count} GPUs")
        device, backend = f"cuda:{index}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    return RunPlan(
        mode=mode,
        accelerator=accelerator,
        device=device,
        backend=backend,
        rank=env.rank,
        local_rank=env.local_rank,
        world_size=env.world_size,
    )
