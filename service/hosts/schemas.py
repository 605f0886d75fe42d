from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class WorkerOut(BaseModel):
    name: str
    address: str
    accelerator: str
    gpus: int
    gpu_ids: list[str]  # the physical GPU behind each slot: the worker's CUDA_VISIBLE_DEVICES entries
    gpus_free: int
    # "online" | "offline" | "quarantined" (online, but taking no new work: contract §8) |
    # "draining" | "drained" (an admin's drain, jobs still stopping there, or none left: §12)
    state: str
    reason: str | None = None  # why it is quarantined
    infra_failures: int = 0  # attempts in a row that ended in an infrastructure failure here
    last_heartbeat: datetime
    started_at: datetime  # when this worker process registered: a restart moves it
    jobs: list[int]  # the caller's own jobs there (the admin: every job)
    isolation: str  # "sandbox" | "none" (contract §7)
    isolation_detail: str  # how ranks are walled off, or why they are not
    open_to_all: bool  # False: unsandboxed, it takes the admin's jobs only
    # False: its multi-node jobs keep the host's network, so it takes the admin's only
    multinode_open_to_all: bool


class WorkerList(BaseModel):
    items: list[WorkerOut]
