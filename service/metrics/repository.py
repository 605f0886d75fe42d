"""All SQL behind the scrape-time metrics. Read-only."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, aliased

from service.jobs.states import QUEUED
from service.models import GpuAllocation, Job, JobAttempt, User


def job_counts_by_state(session: Session) -> dict[str, int]:
    rows = session.execute(select(Job.state, func.count()).group_by(Job.state)).all()
    return {state: int(count) for state, count in rows}


def queue_waits(session: Session) -> Sequence[tuple[datetime, datetime]]:
    """(queued since, started at) of every attempt that started.

    An attempt waited from the moment its job entered the queue: the job's creation for the
    first attempt, the end of the previous attempt (when the job was put back) for a retry.
    """
    previous = aliased(JobAttempt)
    rows = session.execute(
        select(func.coalesce(previous.finished_at, Job.created_at), JobAttempt.started_at)
        .join(Job, Job.id == JobAttempt.job_id)
        .outerjoin(
            previous,
            (previous.job_id == JobAttempt.job_id) & (previous.attempt == JobAttempt.attempt - 1),
        )
        .where(JobAttempt.started_at.is_not(None))
    ).all()
    return [(queued, started) for queued, started in rows if started is not None]


def oldest_queued_since(session: Session) -> datetime | None:
    return session.execute(select(func.min(Job.queued_at)).where(Job.state == QUEUED)).scalar_one()


def gpus_used_by_worker(session: Session) -> dict[str, int]:
    rows = session.execute(
        select(GpuAllocation.worker_name, func.count()).group_by(GpuAllocation.worker_name)
    ).all()
    return {name: int(count) for name, count in rows}


def user_names(session: Session) -> dict[int, str]:
    return dict(session.execute(select(User.id, User.name)).all())


def preempted_attempts(session: Session, reason: str = "preempted") -> int:
    """Attempts that ended preempted (or drained), or with another `reason` ("resized": an
    elastic job's resize), all time (contract §12)."""
    query = select(func.count()).select_from(JobAttempt).where(JobAttempt.reason == reason)
    return int(session.execute(query).scalar_one())
