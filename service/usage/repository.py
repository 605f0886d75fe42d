"""All SQL behind GPU-seconds and the GPUs held now (contract §9)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from service.models import Checkpoint, GpuAllocation, Job, JobAttempt


def gpus_in_use(session: Session, owner_ids: Iterable[int] | None = None) -> dict[int, int]:
    """GPUs held right now, by owner (of these owners; all: None): their jobs' allocation rows."""
    query = select(Job.owner_id, func.count()).join(GpuAllocation, GpuAllocation.job_id == Job.id)
    if owner_ids is not None:
        query = query.where(Job.owner_id.in_(list(owner_ids)))
    return {owner: int(n) for owner, n in session.execute(query.group_by(Job.owner_id)).all()}


def attempts_holding(
    session: Session,
    owner_ids: Iterable[int] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Sequence[Row[int, int, int, datetime | None, datetime | None]]:
    """(job_id, owner_id, gpus, started_at, finished_at) of every attempt that held GPUs at
    some moment of [since, until], of these owners (all: None)."""
    query = (
        select(
            JobAttempt.job_id, Job.owner_id, JobAttempt.gpus, JobAttempt.started_at, JobAttempt.finished_at
        )
        .join(Job, Job.id == JobAttempt.job_id)
        .where(JobAttempt.started_at.is_not(None), JobAttempt.gpus > 0)
    )
    if owner_ids is not None:
        query = query.where(Job.owner_id.in_(list(owner_ids)))
    if until is not None:
        query = query.where(JobAttempt.started_at < until)
    if since is not None:
        query = query.where((JobAttempt.finished_at.is_(None)) | (JobAttempt.finished_at > since))
    return session.execute(query).all()


def ended_gpu_seconds_by_owner(session: Session) -> Sequence[Row[int, float]]:
    """(owner_id, the stored GPU-seconds of their ended attempts) per owner."""
    return session.execute(
        select(Job.owner_id, func.sum(JobAttempt.gpu_seconds))
        .join(Job, Job.id == JobAttempt.job_id)
        .where(JobAttempt.finished_at.is_not(None))
        .group_by(Job.owner_id)
    ).all()


def running_attempts(session: Session) -> Sequence[Row[int, int, datetime | None]]:
    """(owner_id, gpus, started_at) of every attempt started and not ended."""
    return session.execute(
        select(Job.owner_id, JobAttempt.gpus, JobAttempt.started_at)
        .join(Job, Job.id == JobAttempt.job_id)
        .where(JobAttempt.finished_at.is_(None), JobAttempt.started_at.is_not(None))
    ).all()


def checkpoint_bytes_by_owner(session: Session, owner_ids: Sequence[int]) -> dict[int, int]:
    """Bytes of the owners' checkpoints held in storage now (contract §11): every listed
    checkpoint's size (a folder's is the sum of its files)."""
    if not owner_ids:
        return {}
    rows = session.execute(
        select(Checkpoint.owner_id, func.coalesce(func.sum(Checkpoint.size_bytes), 0))
        .where(Checkpoint.owner_id.in_(list(owner_ids)))
        .group_by(Checkpoint.owner_id)
    ).all()
    return {owner: int(total) for owner, total in rows}
