from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class WorkerOut(BaseModel):
    name: str
    address: str
    accelerator: str
    gpus: int
    gpus_free: int
    state: str
    last_heartbeat: datetime
    jobs: list[int]


class WorkerList(BaseModel):
    items: list[WorkerOut]
