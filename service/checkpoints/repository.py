"""All checkpoint SQL: the rows, their files, and a folder checkpoint's parts and looks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import CursorResult, delete, exists, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.models import Checkpoint, CheckpointFile, CheckpointLook, CheckpointPart, Job


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


def delete_files_of(session: Session, ckpt_id: int) -> None:
    """A deleted checkpoint's file rows, so that its objects count as unreferenced."""
    session.execute(delete(CheckpointFile).where(CheckpointFile.checkpoint_id == ckpt_id))


def delete_row(session: Session, ckpt_id: int) -> None:
    """The checkpoint's row, by statement: its files' rows are deleted first by the caller."""
    session.execute(delete(Checkpoint).where(Checkpoint.id == ckpt_id))


def unlink_resumers(session: Session, ckpt_id: int) -> None:
    """Jobs that resumed from the checkpoint keep their `resume_from` but lose the link (the
    foreign key), so that the row can go; the session's copies are not refreshed."""
    session.execute(
        update(Job)
        .where(Job.resume_checkpoint_id == ckpt_id)
        .values(resume_checkpoint_id=None)
        .execution_options(synchronize_session=False)
    )


def lock_resumer(session: Session, ckpt_id: int, states: tuple[str, ...]) -> int | None:
    """A job in `states` that names the checkpoint as its resume point, its row locked (FOR
    UPDATE) so that none can start resuming from it while the caller deletes it."""
    return session.execute(
        select(Job.id)
        .where(Job.resume_checkpoint_id == ckpt_id, Job.state.in_(states))
        .limit(1)
        .with_for_update()
    ).scalar_one_or_none()


def file_keys_of(session: Session, ckpt_id: int) -> list[str]:
    """The storage keys of a folder checkpoint's files: the objects it holds."""
    return list(
        session.execute(select(CheckpointFile.storage_key).where(CheckpointFile.checkpoint_id == ckpt_id))
        .scalars()
        .all()
    )


def held_keys(session: Session, keys: Sequence[str]) -> set[str]:
    """Those of `keys` that a listed checkpoint's file holds, asked 500 at a time (a bound
    parameter list stays far below every database's limit)."""
    held: set[str] = set()
    for i in range(0, len(keys), 500):
        held.update(
            session.execute(
                select(CheckpointFile.storage_key).where(
                    CheckpointFile.storage_key.in_(list(keys[i : i + 500]))
                )
            )
            .scalars()
            .all()
        )
    return held


# -- folder checkpoints' parts and looks (service.checkpoints.folders) ---------------------------


def part_prefixes(session: Session) -> list[str]:
    """The prefix of every part still waiting: its objects may go into a checkpoint yet."""
    return list(session.execute(select(CheckpointPart.prefix)).scalars().all())


def newest_part_id(session: Session) -> int:
    """The highest part id (0 with none): a node's look counts for every part begun before."""
    return int(session.execute(select(func.coalesce(func.max(CheckpointPart.id), 0))).scalar_one())


def add_part(session: Session, part: CheckpointPart) -> CheckpointPart:
    """Add the row and flush it, so that its id is known."""
    session.add(part)
    session.flush()
    return part


def part(session: Session, part_id: int) -> CheckpointPart | None:
    """By primary key: the session's own copy when it holds one already (then no query)."""
    return session.get(CheckpointPart, part_id)


def parts_by_ids(session: Session, part_ids: Sequence[int]) -> Sequence[CheckpointPart]:
    return session.execute(select(CheckpointPart).where(CheckpointPart.id.in_(part_ids))).scalars().all()


def other_part_ids(session: Session, lead: CheckpointPart) -> list[int]:
    """The ids of the node's other parts of the same name in the attempt: `lead` replaces them."""
    return list(
        session.execute(
            select(CheckpointPart.id).where(
                CheckpointPart.job_id == lead.job_id,
                CheckpointPart.attempt == lead.attempt,
                CheckpointPart.node_rank == lead.node_rank,
                CheckpointPart.name == lead.name,
                CheckpointPart.id != lead.id,
            )
        ).scalars()
    )


def later_nodes_parts(session: Session, lead: CheckpointPart) -> Sequence[CheckpointPart]:
    """Every part of `lead`'s name from the attempt's nodes but node 0, by node rank, newest
    first within one: each node's newest is the one listed."""
    return (
        session.execute(
            select(CheckpointPart)
            .where(
                CheckpointPart.job_id == lead.job_id,
                CheckpointPart.attempt == lead.attempt,
                CheckpointPart.name == lead.name,
                CheckpointPart.node_rank > 0,
            )
            .order_by(CheckpointPart.node_rank, CheckpointPart.id.desc())
        )
        .scalars()
        .all()
    )


def part_ids_up_to(session: Session, job_id: int, attempt: int) -> list[int]:
    """The job's parts of this attempt and the earlier ones: all unlisted once its nodes ended."""
    return list(
        session.execute(
            select(CheckpointPart.id).where(
                CheckpointPart.job_id == job_id, CheckpointPart.attempt <= attempt
            )
        ).scalars()
    )


def look(session: Session, job_id: int, attempt: int, node_rank: int) -> CheckpointLook | None:
    """By primary key: the node's last look at its folder."""
    return session.get(CheckpointLook, (job_id, attempt, node_rank))


def add_look(session: Session, row: CheckpointLook) -> None:
    session.add(row)


def looks_of(session: Session, job_id: int, attempt: int) -> Sequence[CheckpointLook]:
    """Every node's last look in the attempt: whether each has looked since a part was begun."""
    return (
        session.execute(
            select(CheckpointLook).where(CheckpointLook.job_id == job_id, CheckpointLook.attempt == attempt)
        )
        .scalars()
        .all()
    )


def delete_looks_up_to(session: Session, job_id: int, attempt: int) -> None:
    """The job's looks of this attempt and the earlier ones, with their parts."""
    session.execute(
        delete(CheckpointLook).where(CheckpointLook.job_id == job_id, CheckpointLook.attempt <= attempt)
    )
