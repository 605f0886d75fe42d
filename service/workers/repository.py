"""All SQL about worker hosts and their GPU slots."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.models import GpuAllocation, Job, Worker


def all_workers(session: Session) -> Sequence[Worker]:
    return session.execute(select(Worker).order_by(Worker.name)).scalars().all()


def allocations(session: Session) -> Sequence[GpuAllocation]:
    return session.execute(select(GpuAllocation)).scalars().all()


def jobs_owned_by(session: Session, owner_id: int, job_ids: set[int]) -> set[int]:
    if not job_ids:
        return set()
    query = select(Job.id).where(Job.owner_id == owner_id, Job.id.in_(job_ids))
    return set(session.execute(query).scalars())


def used_slots(session: Session, allocs: Sequence[GpuAllocation] | None = None) -> dict[str, set[int]]:
    """GPU indices held on each worker, from the allocation rows (read here unless given)."""
    used: dict[str, set[int]] = {}
    for alloc in allocations(session) if allocs is None else allocs:
        used.setdefault(alloc.worker_name, set()).add(alloc.gpu_index)
    return used


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
) -> None:
    worker = session.get(Worker, name, with_for_update=True)
    if worker is None:
        worker = Worker(name=name, started_at=now)
        session.add(worker)
    worker.address, worker.accelerator, worker.gpus = address, accelerator, gpus
    worker.state, worker.session, worker.last_heartbeat, worker.started_at = "online", session_id, now, now
    worker.isolation, worker.isolation_detail = isolation, isolation_detail[:512]
    worker.open_to_all = open_to_all
    worker.gpu_ids = gpu_ids if gpu_ids is not None else [str(i) for i in range(gpus)]


def heartbeat(session: Session, name: str, session_id: str, now: datetime) -> bool:
    """False when another process has taken this worker's name over (a newer session)."""
    result = session.execute(
        update(Worker)
        .where(Worker.name == name, Worker.session == session_id)
        .values(last_heartbeat=now, state="online")
    )
    return result.rowcount == 1


def mark_offline(session: Session, name: str, session_id: str | None = None) -> None:
    query = update(Worker).where(Worker.name == name)
    if session_id is not None:
        query = query.where(Worker.session == session_id)
    session.execute(query.values(state="offline"))


def stale_online(session: Session, before: datetime) -> Sequence[Worker]:
    return (
        session.execute(select(Worker).where(Worker.state == "online", Worker.last_heartbeat < before))
        .scalars()
        .all()
    )
