from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class UsageOut(BaseModel):
    user: str
    gpu_seconds: float
    jobs: int  # jobs with an attempt that held GPUs in the range
    attempts: int


class UsageList(BaseModel):
    items: list[UsageOut]
    since: datetime | None
    until: datetime | None
