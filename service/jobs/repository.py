"""All SQL about jobs, their events, attempts and node runs."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from sqlalchemy import Connection, Select, and_, bindparam, func, or_, select
from sqlalchemy.orm import Session

from service.models import Checkpoint, Job, JobAttempt, JobEvent, NodeRun, User
from service.states import JobState

# The statements of the job view (GET /v1/jobs/{id}, the busiest route) are built once, with
# bind parameters: building a select() per request cost more than compiling it (SQLAlchemy
# caches the compiled form, not the Python statement objects).
_JOB_BY_ID = select(Job).where(Job.id == bindparam("job_id"))
_OWNED_JOB_BY_ID = _JOB_BY_ID.where(Job.owner_id == bindparam("owner_id"))
_NODE_RUNS_OF = (
    select(NodeRun)
    .where(NodeRun.job_id.in_(bindparam("job_ids", expanding=True)))
    .order_by(NodeRun.node_rank)
)
_ATTEMPTS_OF = (
    select(JobAttempt)
    .where(JobAttempt.job_id.in_(bindparam("job_ids", expanding=True)))
    .order_by(JobAttempt.attempt)
)
# A job's newest checkpoint: the highest id among its own, found through the job_id index.
_LATEST_CHECKPOINTS_OF = select(Checkpoint).where(
    Checkpoint.id.in_(
        select(func.max(Checkpoint.id))
        .where(Checkpoint.job_id.in_(bindparam("job_ids", expanding=True)))
        .group_by(Checkpoint.job_id)
    )
)

# The queued jobs ahead of one: higher priority, or the same and older.
_QUEUED_AHEAD_OF = (
    select(func.count())
    .select_from(Job)
    .where(
        Job.state == JobState.QUEUED.value,
        or_(
            Job.priority > bindparam("priority"),
            and_(Job.priority == bindparam("priority"), Job.id < bindparam("job_id")),
        ),
    )
)


def get_job(session: Session, job_id: int, owner_id: int | None) -> Job | None:
    """`owner_id=None` is the admin's view: every job."""
    if owner_id is None:
        return session.execute(_JOB_BY_ID, {"job_id": job_id}).scalar_one_or_none()
    return session.execute(_OWNED_JOB_BY_ID, {"job_id": job_id, "owner_id": owner_id}).scalar_one_or_none()


def job_exists(conn: Connection, job_id: int, owner_id: int | None) -> bool:
    """`owner_id=None`: any owner's (the admin's view)."""
    query = select(Job.id).where(Job.id == job_id)
    if owner_id is not None:
        query = query.where(Job.owner_id == owner_id)
    return conn.execute(query).first() is not None


def get_by_idempotency_key(session: Session, owner_id: int, key: str) -> Job | None:
    return session.execute(
        select(Job).where(Job.owner_id == owner_id, Job.idempotency_key == key)
    ).scalar_one_or_none()


def list_job_ids(
    conn: Connection,
    owner_id: int | None,
    state: str | None,
    limit: int,
    before_id: int | None,
    parent_id: int | None = None,
) -> list[int]:
    """Newest first by id; keyset pagination so page N costs what page 1 costs. Core, on a
    connection: a page served from the job-view cache is this query alone, without a session."""
    params = {"owner_id": owner_id, "state": state, "before_id": before_id, "parent_id": parent_id}
    given = tuple(name for name, value in params.items() if value is not None)
    query = _page_ids_query(given)
    bound = {name: params[name] for name in given} | {"limit": limit}
    return list(conn.execute(query, bound).scalars())


@functools.cache
def _page_ids_query(given: tuple[str, ...]) -> Select[int]:
    """One statement per combination of filters, built once: building it cost more than the
    indexed query itself runs (a page from the job-view cache is this one query)."""
    query = select(Job.id).order_by(Job.id.desc()).limit(bindparam("limit"))
    filters = {
        "owner_id": Job.owner_id == bindparam("owner_id"),
        "state": Job.state == bindparam("state"),
        "before_id": Job.id < bindparam("before_id"),
        "parent_id": Job.parent_id == bindparam("parent_id"),
    }
    return query.where(*(filters[name] for name in given))


def jobs_by_ids(session: Session, job_ids: Sequence[int]) -> list[Job]:
    """The jobs, in the order of `job_ids` (those that exist)."""
    if not job_ids:
        return []
    found = {j.id: j for j in session.execute(select(Job).where(Job.id.in_(job_ids))).scalars()}
    return [found[i] for i in job_ids if i in found]


def owner_names(session: Session, owner_ids: set[int]) -> dict[int, str]:
    rows = session.execute(select(User.id, User.name).where(User.id.in_(owner_ids))).all()
    return {row.id: row.name for row in rows}


def node_runs_for(session: Session, keys: set[tuple[int, int]]) -> list[NodeRun]:
    """The node runs of each (job, attempt). One `job_id IN (...)` over the unique index, the
    attempt checked here: an OR of one AND per job costs more to build and compile than the
    few earlier attempts' rows it avoids reading."""
    if not keys:
        return []
    runs = session.execute(_NODE_RUNS_OF, {"job_ids": sorted({j for j, _ in keys})}).scalars()
    return [r for r in runs if (r.job_id, r.attempt) in keys]


def attempts_for(session: Session, job_ids: set[int]) -> Sequence[JobAttempt]:
    return session.execute(_ATTEMPTS_OF, {"job_ids": sorted(job_ids)}).scalars().all()


def latest_checkpoints(session: Session, job_ids: set[int]) -> dict[int, Checkpoint]:
    rows = session.execute(_LATEST_CHECKPOINTS_OF, {"job_ids": sorted(job_ids)}).scalars().all()
    return {c.job_id: c for c in rows if c.job_id is not None}


def queue_positions(session: Session, jobs: Sequence[Job]) -> dict[int, int]:
    """Place in the queue (1 = next) of each queued job given, in one query however many.

    One job: a count over the (state, priority, id) index. Several: one pass of a window
    function over the queue, instead of one count per job on the page."""
    queued = [j for j in jobs if j.state == JobState.QUEUED]
    if not queued:
        return {}
    if len(queued) == 1:
        job = queued[0]
        params = {"priority": job.priority, "job_id": job.id}
        ahead = session.connection().execute(_QUEUED_AHEAD_OF, params).scalar_one()
        return {job.id: int(ahead) + 1}
    ranked = (
        select(Job.id, func.row_number().over(order_by=(Job.priority.desc(), Job.id)).label("position"))
        .where(Job.state == JobState.QUEUED)
        .subquery()
    )
    rows = session.execute(
        select(ranked.c.id, ranked.c.position).where(ranked.c.id.in_([j.id for j in queued]))
    )
    return {row.id: int(row.position) for row in rows}


def events_after(session: Session, job_id: int, after: int, limit: int) -> Sequence[JobEvent]:
    return (
        session.execute(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.seq > after)
            .order_by(JobEvent.seq)
            .limit(limit)
        )
        .scalars()
        .all()
    )


def progress_events(session: Session, job_id: int) -> Sequence[JobEvent]:
    return (
        session.execute(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.type == "progress")
            .order_by(JobEvent.seq)
        )
        .scalars()
        .all()
    )
