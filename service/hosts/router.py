from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from service.api.deps import AdminDep, SessionDep, UserDep
from service.hosts import service
from service.hosts.schemas import WorkerList, WorkerOut

router = APIRouter(prefix="/v1/workers", tags=["workers"])
WorkerName = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]


@router.get("", response_model=WorkerList)
def list_workers(session: SessionDep, user: UserDep) -> WorkerList:
    return service.list_workers(session, user)


@router.post("/{name}/readmit", response_model=WorkerOut)
def readmit(name: WorkerName, session: SessionDep, _admin: AdminDep) -> WorkerOut:
    """A quarantined host takes work again, its count of failures in a row reset (contract §8);
    a drained (or draining) one too (contract §12)."""
    return service.readmit_worker(session, name)


@router.post("/{name}/drain", response_model=WorkerOut)
def drain(name: WorkerName, session: SessionDep, _admin: AdminDep) -> WorkerOut:
    """Nothing new goes there; what runs there is stopped as if preempted, and queued again
    (contract §12). `state` is `draining`, then `drained`; `readmit` ends it."""
    return service.drain_worker(session, name)
