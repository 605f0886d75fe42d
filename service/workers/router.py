from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import SessionDep, UserDep
from service.workers import service
from service.workers.schemas import WorkerList

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get("", response_model=WorkerList)
def list_workers(session: SessionDep, user: UserDep) -> WorkerList:
    return service.list_workers(session, user)
