from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import SessionDep, UserDep
from service.hosts import service
from service.hosts.schemas import WorkerList

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get("", response_model=WorkerList)
def list_workers(session: SessionDep, user: UserDep) -> WorkerList:
    return service.list_workers(session, user)
