"""Model placement per mode, and the optimizer built on the result.

Order matters and follows torchvision's reference: weights are loaded into the plain model
first, BatchNorm is converted before the DDP wrap (converting after it would leave DDP holding
the old layers), and the optimizer is built afterwards. The unwrapped model is kept beside the
wrapped one: it is what gets saved (no `module.` prefix) and what evaluates under DDP.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.runtime.trainer.config import Hyperparameters
from workers.runtime.trainer.fsdp import shard_model
from workers.runtime.trainer.plan import RunPlan
from workers.runtime.trainer.syncbn import (
    DataParallelWithSyncBN,
    convert_distributed_batchnorm,
    convert_replica_batchnorm,
)


@dataclass(frozen=True, kw_only=True)
class PlacedModel:
    train: nn.Module  # what the training step calls (DDP / DataParallel / FSDP2 / plain)
    bare: nn.Module  # the unwrapped model (fsdp: the sharded one): saved, and its parameters optimised
    eval: nn.Module  # what validation calls: never DDP, whose forward expects a backward


def place_model(model: nn.Module, plan: RunPlan, hp: Hyperparameters | None = None) -> PlacedModel:
    """Convert BatchNorm for the mode, move to the device, wrap."""
    hp = hp if hp is not None else Hyperparameters()
    device = torch.device(plan.device)
    if plan.mode == "fsdp":  # sharded in place: one module trains, evaluates and is saved
        sharded = shard_model(model, plan)
        return PlacedModel(train=sharded, bare=sharded, eval=sharded)
    if plan.mode == "ddp":
        if plan.is_cuda:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:
            model = convert_distributed_batchnorm(model)
        model.to(device)
        broadcast_buffers(model)
        ddp = DistributedDataParallel(
            model,
            device_ids=[device] if plan.is_cuda else None,
            find_unused_parameters=hp.find_unused_parameters,
            static_graph=hp.static_graph,
            **_buffer_sync(every_step=hp.sync_buffers == "step"),
        )
        return PlacedModel(train=ddp, bare=model, eval=model)
    if plan.mode == "dp" and len(plan.dp_device_ids) > 1:
        model = convert_replica_batchnorm(model).to(device)
        wrapped = DataParallelWithSyncBN(model, device_ids=list(plan.dp_device_ids))
        return PlacedModel(train=wrapped, bare=model, eval=wrapped)
    # single, and dp with one GPU or on CPU: a plain forward of the unwrapped model
    model.to(device)
    return PlacedModel(train=model, bare=model, eval=model)


def broadcast_buffers(model: nn.Module) -> None:
    """Every buffer from rank 0, before the first step. A factory model's own buffers (a
    positional table drawn at random, a running average that is not BatchNorm's) would
    otherwise start different on each rank: which torch versions sync them in DDP's constructor
    when `broadcast_buffers` is off has changed, so it is done here, on every version."""
    buffers = [b for b in model.buffers() if b.numel()]
    if buffers and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for buf in buffers:
            dist.broadcast(buf, src=0)


def _buffer_sync(every_step: bool) -> dict[str, Any]:
    """Synchronised BatchNorm keeps its buffers equal, so DDP need not broadcast them every
    forward, unless the spec asks (`sync_buffers: step`: a factory model whose own buffers
    drift apart between ranks during training).

    torch 2.13 renamed `broadcast_buffers` to `forward_sync_buffers` and warns about the old
    name; older versions know only the old one.
    """
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": every_step}
    return {"broadcast_buffers": every_step}


def make_optimizer(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
    """The multi-tensor (`foreach`) implementation everywhere: torch picks it by default only on
    CUDA, and on CPU it is also faster (AdamW on the builtin cnn: 192 against 240 us a step)."""
    if hp.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=hp.lr, momentum=0.9, weight_decay=hp.weight_decay, foreach=True
        )
    return torch.optim.AdamW(model.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, foreach=True)


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any], hp: Hyperparameters
) -> str | None:
    """Load a saved optimizer state if it fits; otherwise leave the optimizer fresh and return why.

    `Optimizer.load_state_dict` checks only the number of parameters, so a state from another
    optimizer or another model would fail later, inside a step; check it here instead. The job's
    lr and weight_decay win over the checkpoint's (the saved groups would override them).
    """
    problem = _optimizer_mismatch(optimizer, state)
    if problem is None:
        try:
            optimizer.load_state_dict(dict(state))
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        return f"optimizer state in the checkpoint not loaded ({problem}); continuing with a fresh optimizer"
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = hp.lr, hp.weight_decay
    return None


# Keys only one optimizer family has: a saved group without ours came from another optimizer.
# (Other keys come and go between torch versions, and load_state_dict fills those in.)
_OPTIMIZER_TELLTALES = frozenset({"betas", "momentum"})


def _optimizer_mismatch(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> str | None:
    saved_groups, saved_state = state.get("param_groups"), state.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, Mapping):
        return "malformed optimizer state"
    if len(saved_groups) != len(optimizer.param_groups):
        return f"{len(saved_groups)} parameter groups saved, {len(optimizer.param_groups)} here"
    params: dict[Any, torch.Tensor] = {}
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        problem = _group_mismatch(saved, group)
        if problem is not None:
            return problem
        params.update(zip(saved["params"], group["params"], strict=True))
    return _state_mismatch(saved_state, params)


def _group_mismatch(saved: Any, group: Mapping[str, Any]) -> str | None:
    """Why a saved parameter group does not fit the optimizer's `group`; None if it does."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list):
        return "malformed parameter group"
    missing = (_OPTIMIZER_TELLTALES & set(group)) - set(saved)
    if missing:
        return f"saved by a different optimizer (no {sorted(missing)})"
    if len(saved["params"]) != len(group["params"]):
        return f"{len(saved['params'])} parameters saved in a group of {len(group['params'])}"
    return None


def _state_mismatch(saved_state: Mapping[Any, Any], params: Mapping[Any, torch.Tensor]) -> str | None:
    """Why the saved per-parameter state does not fit `params` (saved id: parameter); None if it does."""
    for pid, pstate in saved_state.items():
        param = params.get(pid)
        if param is None or not isinstance(pstate, Mapping):
            return f"state for unknown parameter {pid!r}"
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                return f"{key} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
    return None
