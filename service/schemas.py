"""Response models shared by several domains (Checkpoint is embedded in Job and in events)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

MAX_NESTING = 32  # lists and maps inside one request value (a sweep's grid values are free-form)


def unstorable(value: Any) -> str | None:
    """Why a request value cannot be stored, or None: PostgreSQL refuses a NUL character in
    text, and a lone surrogate is not Unicode (no encoder, ours or the database's, takes it).
    Looks through dict keys and values and lists, since specs nest free-form maps; without
    recursion, so that a value nested a thousand deep is refused, not a stack overflow."""
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return "may not contain a NUL character"
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "may not contain a lone surrogate (not valid Unicode)"
        elif isinstance(item, dict | list | tuple):
            if depth >= MAX_NESTING:
                return f"may not nest lists and maps more than {MAX_NESTING} deep"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else list(item)
            todo.extend((child, depth + 1) for child in children)
    return None


def require_storable(value: Any) -> Any:
    why = unstorable(value)
    if why:
        raise ValueError(why)
    return value


def json_safe(value: Any, depth: int = 0) -> Any:
    """`value` with every string encodable (a lone surrogate shown as its escape), so that an
    error that quotes the bad input can itself be sent; cut at `MAX_NESTING` levels ("...")."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict | list | tuple) and depth >= MAX_NESTING:
        return "..."
    if isinstance(value, dict):
        return {json_safe(k, depth + 1): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v, depth + 1) for v in value]
    return value


# Ids and event sequence numbers are 32-bit INTEGER columns: a larger number in a path or a
# query is a 422, never a database error.
MAX_ID = 2**31 - 1


class Output(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class CheckpointOut(Output):
    id: int
    job_id: int | None
    name: str
    epoch: int | None
    step: int | None
    size_bytes: int
    sha256: str
    created_at: datetime
    metrics: dict[str, Any]
    download_url: str
    kind: str = "file"  # contract §11: "file" | "folder"
    files: int = 1


def checkpoint_out(ckpt: Any) -> CheckpointOut:
    return CheckpointOut(
        id=ckpt.id,
        job_id=ckpt.job_id,
        name=ckpt.name,
        epoch=ckpt.epoch,
        step=ckpt.step,
        size_bytes=ckpt.size_bytes,
        sha256=ckpt.sha256,
        created_at=ckpt.created_at,
        metrics=ckpt.metrics or {},
        download_url=f"/v1/checkpoints/{ckpt.id}/download",
        kind=ckpt.kind or "file",
        files=ckpt.files if ckpt.files is not None else 1,
    )
