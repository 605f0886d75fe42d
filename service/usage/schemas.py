from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class UsageOut(BaseModel):
    user: str
    gpu_seconds: float
    jobs: int  # jobs with an attempt that held GPUs in the range
    attempts: int
    checkpoint_bytes: int = 0  # contract §11: the user's checkpoints held in storage now


class UsageList(BaseModel):
    items: list[UsageOut]
    since: datetime | None
    until: datetime | None
