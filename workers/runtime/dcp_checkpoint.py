"""DCP checkpoint folders (contract §11): what `mode: fsdp` writes and resumes from.

A folder written by `torch.distributed.checkpoint` (DCP) holds one `__R_0.distcp` file per rank
and a `.metadata` file, which DCP's coordinator writes last, once every rank's data is written
(`FileSystemWriter.finish`: `.metadata.tmp`, then a rename): the platform takes a folder as
complete when `.metadata` appears, so the trainer writes the folder under its final name.
Beside the shards, rank 0 writes `torchjobs.pt` before the save begins (so before `.metadata`):
epoch, step and meta (mode, world size, hyperparameters, every rank's RNG state), in the same
weights-only layout as the checkpoint file (contract §5) minus the weights.

This module reads and checks such folders without joining any process group; the sharded
loading and saving live in `workers.runtime.trainer.fsdp`.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.runtime.checkpoint import (
    checkpoint_name,
    load_checkpoint,
    read_checkpoint,
    to_cpu,
    write_atomic,
)
from workers.runtime.errors import CheckpointError

METADATA_FILE = ".metadata"  # DCP's; its presence means the folder is complete
STATE_FILE = "torchjobs.pt"  # epoch, step and meta of a folder the builtin trainer wrote
FOLDER_MODES = ("fsdp",)  # the modes whose checkpoints are DCP folders


@dataclass(frozen=True, kw_only=True)
class DcpResume:
    """A DCP folder to resume from: its tensors are loaded into the sharded model later, by
    every rank; position and RNG come from its `torchjobs.pt`."""

    path: Path
    epoch: int = 0
    step: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def is_dcp_folder(path: Path) -> bool:
    """A folder holding DCP's `.metadata` (a real file, not a link)."""
    marker = path / METADATA_FILE
    return path.is_dir() and marker.is_file() and not marker.is_symlink()


def folder_name(epoch: int, step: int, *, mid_epoch: bool) -> str:
    """`epoch-0003` at an epoch boundary, `epoch-0002-step-00000040` inside an epoch: the file
    checkpoints' names without `.pt`."""
    return checkpoint_name(epoch, step, mid_epoch=mid_epoch).removesuffix(".pt")


def read_dcp_resume(path: Path) -> DcpResume:
    """The folder's position and meta; a DCP folder that another program wrote (no
    `torchjobs.pt`) starts at epoch 0, its tensors loaded if their names fit."""
    if not is_dcp_folder(path):
        raise CheckpointError(f"checkpoint {path.name} is not a DCP checkpoint folder (no {METADATA_FILE})")
    state_path = path / STATE_FILE
    if not state_path.is_file():
        return DcpResume(path=path)
    raw = read_checkpoint(state_path, source=f"{path.name}/{STATE_FILE}")
    if not isinstance(raw, Mapping) or not isinstance(raw.get("meta", {}), Mapping):
        raise CheckpointError(f"{path.name}/{STATE_FILE}: expected {{'epoch', 'step', 'meta'}}")
    return DcpResume(
        path=path,
        epoch=_count(raw.get("epoch", 0), "epoch", path),
        step=_count(raw.get("step", 0), "step", path),
        meta=dict(raw.get("meta", {})),
    )


def _count(value: Any, name: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(
            f"{path.name}/{STATE_FILE}: {name!r} must be a non-negative integer, not {value!r}"
        )
    return value


def remove_stale_folder(folder: Path) -> None:
    """Remove what an earlier attempt left under this checkpoint's name (a folder cut short by
    a crash, or one written at another world size, whose extra shards DCP would not
    overwrite), so that the new folder holds only its own files. A link is only unlinked."""
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    elif folder.is_dir():
        shutil.rmtree(folder)


def write_trainer_state(folder: Path, *, epoch: int, step: int, meta: Mapping[str, Any]) -> None:
    """Rank 0's `torchjobs.pt`, written atomically into `folder` (created) before the shards."""
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic({"epoch": int(epoch), "step": int(step), "meta": to_cpu(dict(meta))}, folder / STATE_FILE)


def load_resume_source(
    path: Path, mode: str
) -> DcpResume | tuple[dict[str, Any], dict[str, Any] | None, int, int, dict[str, Any]]:
    """What `TORCHJOBS_RESUME_FROM` holds, read as the job's mode needs it.

    fsdp resumes from a DCP folder only, and the other modes from a file only: a clear refusal
    names the mismatch instead of failing deep inside a load (a file holds full tensors for one
    process, a DCP folder shards that only `dcp.load` into a sharded model reads).
    """
    if mode in FOLDER_MODES:
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint {path.name} is a file (single, dp or ddp); mode {mode} resumes only from "
                f"a DCP checkpoint folder (one holding {METADATA_FILE}, as mode {mode} writes them)"
            )
        return read_dcp_resume(path)
    if path.is_dir():
        raise CheckpointError(
            f"checkpoint {path.name} is a folder (a DCP checkpoint, as mode fsdp writes them); mode "
            f"{mode} resumes only from a checkpoint file: resume it with mode fsdp"
        )
    return load_checkpoint(path)
