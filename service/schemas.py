"""Response models shared by several domains (Checkpoint is embedded in Job and in events)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

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
