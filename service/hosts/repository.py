"""All SQL about worker hosts and their GPU slots."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import GpuAllocation, Job, Worker
from service.states import WorkerState


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


def stale_online(session: Session, before: datetime) -> Sequence[Worker]:
    return (
        session.execute(
            select(Worker).where(Worker.state == WorkerState.ONLINE, Worker.last_heartbeat < before)
        )
        .scalars()
        .all()
    )
