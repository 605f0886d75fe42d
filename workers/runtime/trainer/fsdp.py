"""`mode: fsdp` (contract §11): FSDP2 sharding and DCP checkpoints written asynchronously.

The model is sharded with `fully_shard` per block (each child module that holds parameters,
and each member of a child ModuleList/ModuleDict, as torchtitan shards transformer blocks) and
at the root, over one DeviceMesh of every rank of every node. BatchNorm is synchronised as in
ddp first (its buffers are not sharded, so they stay equal on every rank and DCP saves one copy).

Checkpoints are DCP folders. `DcpSaver.save` stages the sharded model and optimizer state into
CPU memory (a copy: training may change the live tensors at once), then writes in a background
thread while training goes on; a save waits for the previous one first, and the trainer waits
for the last before exiting. The background thread's collectives run on a gloo group of their
own: gloo runs one collective at a time per group, in order, so sharing the training's group
from a second thread would interleave the two streams differently on different ranks (a
hang), and `async_save` needs a CPU backend anyway, which the nccl group of a CUDA job is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from workers.runtime.errors import CheckpointError, ConfigError
from workers.runtime.trainer.plan import RunPlan
from workers.runtime.trainer.syncbn import convert_distributed_batchnorm

MODEL_KEY, OPTIM_KEY = "model", "optim"  # the two top-level entries of every fsdp DCP folder
BLOCKING_ENV = "TORCHJOBS_FSDP_BLOCKING_SAVE"


def shard_model(model: nn.Module, plan: RunPlan) -> nn.Module:
    """Synchronise BatchNorm, move to the device, shard each block and then the root."""
    if plan.is_cuda:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    else:
        model = convert_distributed_batchnorm(model)
    device = torch.device(plan.device)
    model.to(device)
    mesh = init_device_mesh(device.type, (plan.world_size,), mesh_dim_names=("shard",))
    for block in shard_units(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks sharded one by one below the root: each direct child holding parameters, and
    for a ModuleList/ModuleDict child (which has no forward of its own) each of its members."""
    units: list[nn.Module] = []
    for child in model.children():
        members = list(child.children()) if isinstance(child, nn.ModuleList | nn.ModuleDict) else [child]
        units.extend(m for m in members if any(True for _ in m.parameters()))
    return units


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """FSDP2's `no_sync`: inside a gradient-accumulation group, keep the micro-batch gradients
    unsharded and local; the group's last backward reduce-scatters their sum."""
    if enabled or not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def checkpoint_group() -> Any:
    """A gloo group for DCP's own collectives (see the module docstring); every rank calls it."""
    return dist.new_group(backend="gloo")


def blocking_saves_asked(environ: Mapping[str, str]) -> bool:
    """`TORCHJOBS_FSDP_BLOCKING_SAVE=1`: every save returns only once its folder is written (a
    synchronous `dcp.save`), the floor `bench/fsdp_checkpoint.py` measures the async save by."""
    return environ.get(BLOCKING_ENV, "").strip() == "1"


class DcpSaver:
    """At most one asynchronous DCP save in flight; `wait` surfaces its error, if any.
    `blocking`: every save is synchronous instead (see `blocking_saves_asked`)."""

    def __init__(self, group: Any, *, blocking: bool = False) -> None:
        self._group = group
        self.blocking = blocking
        self._pending: Future[Any] | None = None
        self._pending_path: Path | None = None

    def save(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Stage this rank's shards and write them into `folder`; return once they are staged
        (blocking: once the folder is complete). Every rank calls it at the same step."""
        self.wait()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {MODEL_KEY: model_state, OPTIM_KEY: optim_state}
        if self.blocking:
            dcp.save(state, checkpoint_id=folder, process_group=self._group)
            return
        future = dcp.async_save(state, checkpoint_id=folder, process_group=self._group)
        self._pending, self._pending_path = cast("Future[Any]", future), folder

    def wait(self) -> None:
        """Block until the save in flight (if any) has written its folder."""
        pending, path = self._pending, self._pending_path
        self._pending = self._pending_path = None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:
            raise CheckpointError(f"writing checkpoint {path} failed: {type(exc).__name__}: {exc}") from exc

    @property
    def in_flight(self) -> bool:
        return self._pending is not None


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any) -> None:
    """Load a DCP folder into the sharded model and optimizer, resharding to this world size.

    The state dicts of the live model and optimizer say what to read (DCP reads into them in
    place, each rank its own shard); a folder whose names or shapes do not fit is refused."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {MODEL_KEY: model_state, OPTIM_KEY: optim_state}
    try:
        dcp.load(state, checkpoint_id=path, process_group=group)
    except Exception as exc:  # DCP raises CheckpointException, RuntimeError, KeyError...
        raise CheckpointError(
            f"checkpoint {path.name} does not fit this model and optimizer: {type(exc).__name__}: {exc}"
        ) from exc
    # dcp.load filled both in place
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`{"model", "optim"}` unsharded, on the CPU of rank 0 (empty on the others), named as in
    the DCP folder. A collective: every rank calls it. Used by the test-only debug dumps."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {MODEL_KEY: model_state, OPTIM_KEY: optim_state}


def forwards_behind(mine: int, group: Any) -> int:
    """How many forwards fewer than the busiest rank this rank's validation runs. Every FSDP
    forward all-gathers parameters with every other rank, and validation shards may differ by a
    batch, so a rank short of batches runs that many more (results discarded) after its own:
    agreed before any forward, since a rank waiting here while another is inside a forward's
    all-gather would wait forever."""
    most = torch.tensor([mine], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return int(most.item()) - mine


def pad_forwards(model: nn.Module, probe: torch.Tensor | None, missing: int) -> None:
    """Run `missing` forwards of `probe` (one input sample this rank has seen)."""
    if missing and probe is None:
        raise ConfigError("this rank has no input to run the validation forwards its peers run")
    for _ in range(missing):
        model(cast(torch.Tensor, probe))
