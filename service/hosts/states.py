"""The one writer of `Worker.state` (the table of moves is `service.states.WORKER_TRANSITIONS`).

A worker host is online from its start (`upsert_worker`) and with every heartbeat; it goes
offline when it stops (`mark_offline`) or when the scheduler's reaper finds it silent
(`take_offline`). A heartbeat from a host taken offline brings it back.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, update
from sqlalchemy.orm import Session

from service.hosts.repository import bump_capacity_version
from service.models import Worker
from service.states import WorkerState, worker_may_move

# The states each move may start from, read off the table: the bulk UPDATEs below apply it in
# their WHERE clause, the ORM writers check it before they write.
MAY_GO_ONLINE = [s.value for s in WorkerState if worker_may_move(s, WorkerState.ONLINE)]
MAY_GO_OFFLINE = [s.value for s in WorkerState if worker_may_move(s, WorkerState.OFFLINE)]


def upsert_worker(
    session: Session,
    *,
    name: str,
    address: str,
    accelerator: str,
    gpus: int,
    session_id: str,
    now: datetime,
    gpu_ids: list[str] | None = None,
    isolation: str = "none",
    isolation_detail: str = "",
    open_to_all: bool = True,
    multinode_open_to_all: bool = True,
    meshes: bool = True,
) -> None:
    worker = session.get(Worker, name, with_for_update=True)
    if worker is not None and not worker_may_move(worker.state, WorkerState.ONLINE):
        raise ValueError(f"worker {name} cannot go from {worker.state} to online")
    if worker is None or (worker.gpus, worker.accelerator) != (gpus, accelerator):
        bump_capacity_version(session)  # what a job is checked against changed (`POST /v1/jobs`)
    if worker is None:
        worker = Worker(name=name, started_at=now)
        session.add(worker)
    worker.address, worker.accelerator, worker.gpus = address, accelerator, gpus
    worker.state = WorkerState.ONLINE.value
    worker.session, worker.last_heartbeat, worker.started_at = session_id, now, now
    worker.isolation, worker.isolation_detail = isolation, isolation_detail[:512]
    worker.open_to_all, worker.multinode_open_to_all = open_to_all, multinode_open_to_all
    worker.meshes = meshes
    worker.gpu_ids = gpu_ids if gpu_ids is not None else [str(i) for i in range(gpus)]


def heartbeat(session: Session, name: str, session_id: str, now: datetime) -> bool:
    """False when another process has taken this worker's name over (a newer session)."""
    result = session.execute(
        update(Worker)
        .where(Worker.name == name, Worker.session == session_id, Worker.state.in_(MAY_GO_ONLINE))
        .values(last_heartbeat=now, state=WorkerState.ONLINE.value)
    )
    return cast(CursorResult[Any], result).rowcount == 1


def mark_offline(session: Session, name: str, session_id: str | None = None) -> None:
    query = update(Worker).where(Worker.name == name, Worker.state.in_(MAY_GO_OFFLINE))
    if session_id is not None:
        query = query.where(Worker.session == session_id)
    session.execute(query.values(state=WorkerState.OFFLINE.value))


def take_offline(worker: Worker) -> bool:
    """The reaper's verdict on a silent host; False when it is offline already."""
    if worker.state == WorkerState.OFFLINE or not worker_may_move(worker.state, WorkerState.OFFLINE):
        return False
    worker.state = WorkerState.OFFLINE.value
    return True
