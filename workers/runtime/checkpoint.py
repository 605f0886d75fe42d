"""The checkpoint file (contract §5): reading every accepted layout safely, writing atomically.

Reading never unpickles arbitrary objects: `torch.load(weights_only=True)` only, and a file
that needs more is refused before anything in it can run. Reading (`read_checkpoint`) and the
layout checks (`normalize_checkpoint`) are pure functions of the file, so that the platform
validates uploads with this very code in a throwaway subprocess
(`service.checkpoints.upload_check`), and an accepted upload is one that resumes:

    python -m workers.runtime.checkpoint PATH   # prints a JSON summary, or exits 2 with the reason

Accepted layouts (weight names are returned as stored; `fit_state_dict` drops the prefixes
that wrappers add, `module.` from DataParallel or DDP and `_orig_mod.` from torch.compile,
where the model to load into does not have them itself):

    {"state_dict": {"net": weights}, "optimizer": opt, "epoch", "step", "meta"}   torchjobs
    {"state_dict": {"net": weights}, "optimizer": opt}                            seed, single GPU
    {"state_dict": {"net": weights}, "optimizer": {"net": opt}}                   seed, DDP
    {"state_dict": weights, ...}                                                  flat state_dict
    weights                                                                       a bare state dict
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from workers.runtime.errors import CheckpointError
from workers.runtime.marks import checkpoint_done  # noqa: F401  (contract §11; also workers.runtime's)

# What wrappers put in front of the wrapped model's names: DataParallel and DDP, torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def load_checkpoint(
    path: str | os.PathLike[str],
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, int, int, dict[str, Any]]:
    """(net_state, optimizer_state or None, completed epochs, global step, meta) of a checkpoint.

    Epoch and step are 0 for layouts that do not record them (seed files, bare state dicts).
    Raises CheckpointError, naming the file and the reason, for anything else.
    """
    return normalize_checkpoint(read_checkpoint(path), source=str(path))


def read_checkpoint(path: str | os.PathLike[str], *, source: str | None = None, mmap: bool = False) -> Any:
    """The object a checkpoint file holds, loaded on the CPU with `torch.load(weights_only=True)`
    only; CheckpointError, naming `source` (the path by default) and the reason, for a file that
    is missing, would need arbitrary Python objects (refused before anything in it ran), or is no
    torch checkpoint. `mmap`: map a zip-format file's tensors instead of reading them into memory
    (a file too large to read whole; a legacy-format file, which cannot be mapped, is read)."""
    name = f"checkpoint {source if source is not None else path}"
    if not Path(path).is_file():
        raise CheckpointError(f"{name} does not exist or is not a file")
    try:
        return _torch_load(Path(path), mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise _refusal(exc, name) from None
    except Exception as exc:  # corrupt zip, truncated file, wrong format: all mean "unreadable"
        raise CheckpointError(f"{name} is unreadable: {type(exc).__name__}: {exc}") from None


def _torch_load(path: Path, *, mmap: bool) -> Any:
    if mmap:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # the legacy (pre-zip) format cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
    return torch.load(path, map_location="cpu", weights_only=True)


def _refusal(exc: pickle.UnpicklingError, name: str) -> CheckpointError:
    """What the weights-only unpickler's refusal means: a pickle that would build arbitrary
    objects, or no torch checkpoint at all (an opcode it does not know: random bytes, a plain
    pickle of a newer protocol)."""
    text = str(exc)
    operand = next(
        (ln.strip() for ln in text.splitlines() if ln.strip().startswith("Unsupported operand")), None
    )
    if operand is not None or "weights only" not in text.lower():
        return CheckpointError(f"{name} is not a torch checkpoint ({operand or text.strip()})")
    return CheckpointError(
        f"{name} refused: it needs more than torch.load(weights_only=True) allows "
        f"(arbitrary Python objects), so it was not loaded and nothing in it ran "
        f"({_unpickler_reason(exc)})"
    )


def _unpickler_reason(exc: Exception) -> str:
    """The specific reason from torch's message (the global it refused, when it names one),
    without its advice to retry with weights_only=False (which is exactly what must not happen
    here)."""
    text = str(exc)
    refused_global = next((ln.strip() for ln in text.splitlines() if "Unsupported global" in ln), "")
    if refused_global:
        return refused_global.split(" was not")[0][:300]
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    boilerplate = ("Weights only load failed", "Check the documentation")
    specific = [p for p in paragraphs if not p.startswith(boilerplate)]
    return " ".join(specific) or "an object outside the allowed types"


def normalize_checkpoint(
    raw: Any, *, source: str = "checkpoint"
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, int, int, dict[str, Any]]:
    """The same as `load_checkpoint`, for an object already loaded."""
    if not isinstance(raw, Mapping):
        raise CheckpointError(f"{source}: expected a dict at the top level, found {type(raw).__name__}")
    if "state_dict" not in raw:
        return _weights(raw, source), None, 0, 0, {}
    state = raw["state_dict"]
    net = state["net"] if isinstance(state, Mapping) and isinstance(state.get("net"), Mapping) else state
    meta = raw.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"{source}: 'meta' must be a dict, found {type(meta).__name__}")
    return (
        _weights(net, source),
        _optimizer(raw.get("optimizer"), source),
        _count(raw.get("epoch", 0), "epoch", source),
        _count(raw.get("step", 0), "step", source),
        dict(meta),
    )


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DataParallel, DDP and torch.compile wrappers, told apart by type.

    Saving this model's own state dict is what keeps wrapper prefixes out of checkpoints; taking
    names apart instead would also cut a real submodule called `module` (an EMA copy, a wrapper
    of the user's own) out of its names.
    """
    while True:
        if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        elif _is_compiled(model):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model


def _is_compiled(model: nn.Module) -> bool:
    """torch.compile's OptimizedModule, recognised without importing torch._dynamo (slow)."""
    return type(model).__name__ == "OptimizedModule" and isinstance(
        model._modules.get("_orig_mod"), nn.Module
    )


def fit_state_dict(state: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state` with the names `model` (unwrapped) has: a leading wrapper prefix is dropped from a
    name, again and again, only while the model has no such name, so a submodule that really is
    called `module` keeps its names, and a seed DDP save (`module.` on everything) still loads.
    Names the model does not know are left for `load_state_dict` to report."""
    wanted = set(unwrap_model(model).state_dict())
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key
        while name not in wanted and name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        name = name if name in wanted else key
        if name in out:
            raise CheckpointError(
                f"weight {name!r} appears twice in the checkpoint, with and without a wrapper prefix "
                f"({', '.join(repr(p) for p in WRAPPER_PREFIXES)})"
            )
        out[name] = value
    return out


def _weights(state: Any, source: str) -> dict[str, torch.Tensor]:
    if not isinstance(state, Mapping) or not state:
        raise CheckpointError(
            f"{source}: no weights found; expected {{'state_dict': {{'net': ...}}}} or a bare state dict"
        )
    bad = [str(k) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(
            f"{source}: not a state dict of named tensors (offending keys: {bad[:5]}); expected "
            "{'state_dict': {'net': ...}, 'optimizer': ...} or a bare state dict"
        )
    return dict(state)


def _optimizer(opt: Any, source: str) -> dict[str, Any] | None:
    if opt is None:
        return None
    if isinstance(opt, Mapping) and "state" not in opt and isinstance(opt.get("net"), Mapping):
        opt = opt["net"]  # the seed's DDP layout
    if not isinstance(opt, Mapping) or not {"state", "param_groups"} <= set(opt):
        raise CheckpointError(f"{source}: 'optimizer' is not an optimizer state_dict")
    return dict(opt)


def _count(value: Any, name: str, source: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{source}: {name!r} must be a non-negative integer, found {value!r}")
    return value


def build_checkpoint(
    *,
    net_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    epoch: int,
    step: int,
    meta: Mapping[str, Any],
) -> dict[str, Any]:
    """The torchjobs layout, every tensor on the CPU: a checkpoint written on GPUs must still load
    with a bare `torch.load(path, weights_only=True)` on a machine without one. `net_state` is
    the unwrapped model's (`unwrap_model`), so it holds no wrapper prefix to remove."""
    return {
        "state_dict": {"net": to_cpu(dict(net_state))},
        "optimizer": to_cpu(dict(optimizer_state)),
        "epoch": int(epoch),
        "step": int(step),
        "meta": to_cpu(dict(meta)),
    }


def to_cpu(obj: Any) -> Any:
    """The same nesting of dicts, lists and tuples with CPU tensors (no copy of CPU tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def write_atomic(obj: Any, path: Path) -> None:
    """torch.save to `<name>.tmp`, fsync, rename into place: the platform, which takes every
    complete file in the folder, never sees a half-written checkpoint under its final name."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def checkpoint_name(epoch: int, step: int, *, mid_epoch: bool) -> str:
    """`epoch-0003.pt` at an epoch boundary; a preemption inside an epoch adds the step."""
    return f"epoch-{epoch:04d}-step-{step:08d}.pt" if mid_epoch else f"epoch-{epoch:04d}.pt"


def _summary(path: str) -> dict[str, Any]:
    net, opt, epoch, step, meta = load_checkpoint(path)
    return {
        "epoch": epoch,
        "step": step,
        "tensors": len(net),
        "parameters": int(sum(t.numel() for t in net.values())),
        "has_optimizer": opt is not None,
        "meta": {k: v for k, v in meta.items() if k != "rng"},
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workers.runtime.checkpoint PATH", file=sys.stderr)
        return 2
    try:
        summary = _summary(args[0])
    except CheckpointError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
