"""All checkpoint SQL."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import CursorResult, delete, exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.models import Checkpoint, CheckpointFile, Job


def get(
    session: Session, ckpt_id: int, owner_id: int | None, *, share_lock: bool = False
) -> Checkpoint | None:
    """`owner_id=None` is the admin's view: every checkpoint. `share_lock`: FOR SHARE, so that
    retention cannot delete it before the caller commits."""
    query = select(Checkpoint).where(Checkpoint.id == ckpt_id)
    if owner_id is not None:
        query = query.where(Checkpoint.owner_id == owner_id)
    return session.execute(query.with_for_update(read=True) if share_lock else query).scalar_one_or_none()


def by_id(session: Session, ckpt_id: int) -> Checkpoint | None:
    """By primary key: the session's own copy when it holds one already (then no query)."""
    return session.get(Checkpoint, ckpt_id)


def latest_of_job(session: Session, job_id: int, *, share_lock: bool = False) -> Checkpoint | None:
    """The job's newest checkpoint; `share_lock` as in `get`."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id.desc()).limit(1)
    return session.execute(query.with_for_update(read=True) if share_lock else query).scalar_one_or_none()


def latest_id_of_job(session: Session, job_id: int) -> int | None:
    return session.execute(
        select(Checkpoint.id).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id.desc()).limit(1)
    ).scalar_one_or_none()


def list_for_job(session: Session, job_id: int) -> Sequence[Checkpoint]:
    """Oldest first: ids rise in the order the checkpoints were recorded."""
    return (
        session.execute(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id))
        .scalars()
        .all()
    )


def files_of(session: Session, ckpt_id: int) -> Sequence[CheckpointFile]:
    """A folder checkpoint's file rows, in no particular order (the manifest sorts by bytes)."""
    return (
        session.execute(select(CheckpointFile).where(CheckpointFile.checkpoint_id == ckpt_id)).scalars().all()
    )


def file_at(session: Session, ckpt_id: int, path: str) -> CheckpointFile | None:
    query = select(CheckpointFile).where(CheckpointFile.checkpoint_id == ckpt_id, CheckpointFile.path == path)
    return session.execute(query).scalar_one_or_none()


def add(session: Session, ckpt: Checkpoint) -> Checkpoint:
    session.add(ckpt)
    session.flush()
    return ckpt


def retention_candidates(session: Session, job_id: int, keep_last: int) -> Sequence[Checkpoint]:
    """The job's checkpoints past its newest `keep_last` that nothing still needs.

    Needed, and so never returned: any checkpoint a job names as its resume point (a queued job
    will fetch it, and the foreign key keeps the row of a finished one), and the newest one of
    the job's earlier attempts while the job is on a later one (what the running retry resumed
    from, and may still be fetching on another node).
    """
    job = session.get(Job, job_id)
    if job is None:
        return []
    newest = select(Checkpoint.id).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id.desc())
    keep = set(session.execute(newest.limit(keep_last)).scalars().all())
    if job.attempt > 1:
        resumed = session.execute(
            newest.where(Checkpoint.attempt < job.attempt).limit(1)
        ).scalar_one_or_none()
        if resumed is not None:
            keep.add(resumed)
    referenced = exists().where(Job.resume_checkpoint_id == Checkpoint.id)
    rows = session.execute(
        select(Checkpoint).where(Checkpoint.job_id == job_id, ~referenced).order_by(Checkpoint.id)
    ).scalars()
    return [c for c in rows if c.id not in keep]


def delete_unreferenced(session: Session, ckpt: Checkpoint) -> bool:
    """Delete one row unless a job started to reference it meanwhile; True when it went."""
    try:
        with session.begin_nested():
            gone = session.execute(
                delete(Checkpoint)
                .where(Checkpoint.id == ckpt.id, ~exists().where(Job.resume_checkpoint_id == Checkpoint.id))
                .execution_options(synchronize_session=False)
            )
    except IntegrityError:  # a job referencing it committed between our check and the delete
        return False
    return bool(cast(CursorResult[Any], gone).rowcount)
