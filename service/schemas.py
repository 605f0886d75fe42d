"""Response models shared by several domains (Checkpoint is embedded in Job and in events)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict


def unstorable(value: Any) -> str | None:
    """Why a request value cannot be stored, or None: PostgreSQL refuses a NUL character in
    text, and a lone surrogate is not Unicode (no encoder, ours or the database's, takes it).
    Looks through dict keys and values and lists, since specs nest free-form maps."""
    if isinstance(value, str):
        if "\x00" in value:
            return "may not contain a NUL character"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "may not contain a lone surrogate (not valid Unicode)"
        return None
    if isinstance(value, dict):
        items: list[Any] = [*value.keys(), *value.values()]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        return None
    return next((why for why in map(unstorable, items) if why), None)


def require_storable(value: Any) -> Any:
    why = unstorable(value)
    if why:
        raise ValueError(why)
    return value


def json_safe(value: Any) -> Any:
    """`value` with every string encodable (a lone surrogate shown as its escape), so that an
    error that quotes the bad input can itself be sent."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
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
    )
