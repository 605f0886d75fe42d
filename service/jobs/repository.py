"""All SQL about jobs, their events, attempts, node runs, dependencies, sweeps (their rungs
included) and metric series, but the writers that keep theirs next to a lock or a state gate
(`service.jobs.states`, `service.scheduler.placement_pass`: ARCHITECTURE.md names them)."""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    Result,
    Row,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    case,
    cast,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, aliased

from service.models import (
    Checkpoint,
    Job,
    JobAttempt,
    JobDependency,
    JobEvent,
    LogChunk,
    MetricName,
    MetricPoint,
    NodeRun,
    QueueCount,
    SweepRung,
    User,
)
from service.states import JOB_ACTIVE, JOB_TERMINAL, NODE_ACTIVE, SWEEP, JobState, NodeState

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


def children_by_objective(
    conn: Connection, parent_id: int, state: str | None, limit: int, offset: int
) -> list[int]:
    """A sweep's children by `objective_value` (the parent's mode), those without one last."""
    sweep: dict[str, Any] = (
        conn.execute(select(Job.sweep).where(Job.id == parent_id)).scalar_one_or_none() or {}
    )
    mode = (sweep.get("objective") or {}).get("mode", "min")
    value = Job.objective_value
    query = (
        select(Job.id)
        .where(Job.parent_id == parent_id)
        .order_by(value.is_(None), value.asc() if mode == "min" else value.desc(), Job.id)
        .limit(limit)
        .offset(offset)
    )
    if state is not None:
        query = query.where(Job.state == state)
    return list(conn.execute(query).scalars())


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


# -- queue counts (service/models/jobs.py `QueueCount`) ------------------------------------------

NEW, MOVED = "new", "moved"  # QueueCount.source
QUEUE_COUNTS = typing.cast(Table, QueueCount.__table__)  # (Core, not the ORM's bulk insert of rows)
# The jobs queued at `priority` and above as counted, but for the "new" row at `priority`
# itself: a new job's position is that row as its own bump returned it, plus these.
QUEUED_ABOVE_BUT_NEW = select(func.coalesce(func.sum(QueueCount.jobs), 0)).where(
    QueueCount.priority >= bindparam("priority", type_=Integer),
    or_(QueueCount.priority != bindparam("priority", type_=Integer), QueueCount.source != NEW),
)


def queued_above_but_new(conn: Connection, priority: int) -> int:
    return int(conn.execute(QUEUED_ABOVE_BUT_NEW, {"priority": priority}).scalar_one())


def add_queue_counts(session: Session, deltas: dict[tuple[str, int], int]) -> None:
    """Add each {(source, priority): delta} to its row (made when missing), in one statement,
    in one order for every transaction: every "new" row before any "moved" one, each kind by
    priority. Two transactions that both hold rows of the other's never wait crosswise."""
    rows = [
        {"priority": priority, "source": source, "jobs": delta}
        for (source, priority), delta in sorted(deltas.items(), key=lambda d: (d[0][0] != NEW, d[0][1]))
        if delta
    ]
    if rows:
        session.execute(_upsert_counts(session.get_bind().dialect.name), rows)


@functools.cache
def _upsert_counts(dialect: str) -> Any:
    """`INSERT … ON CONFLICT DO UPDATE SET jobs = jobs + excluded.jobs`."""
    stmt = counts_insert(dialect)
    return adding_on_conflict(stmt, stmt.excluded.jobs)


def counts_insert(dialect: str) -> Any:
    """An INSERT into `queue_counts` by the database's own `insert` (ON CONFLICT is the same SQL
    on both, built by each dialect's construct)."""
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(QUEUE_COUNTS)


def adding_on_conflict(stmt: Any, added: Any) -> Any:
    """`stmt` that adds `added` to the row's count where the (priority, source) row exists."""
    counts = QUEUE_COUNTS.c
    return stmt.on_conflict_do_update(
        index_elements=[counts.priority, counts.source], set_={"jobs": counts.jobs + added}
    )


def queue_counts(session: Session) -> dict[int, int]:
    """{priority: queued jobs} as counted (what tests compare with the queue itself)."""
    rows = session.execute(
        select(QueueCount.priority, func.sum(QueueCount.jobs)).group_by(QueueCount.priority)
    ).all()
    return {int(priority): int(n) for priority, n in rows if n}


def lock_queue_counts(session: Session) -> dict[int, int]:
    """{priority: counted jobs}, every count row locked until the transaction ends, in the
    order every writer takes them (`add_queue_counts`): a recount sees no move half made."""
    rows = session.execute(
        select(QueueCount.priority, QueueCount.source, QueueCount.jobs)
        .order_by(QueueCount.source != NEW, QueueCount.priority)
        .with_for_update()
    ).all()
    counted: dict[int, int] = {}
    for priority, _source, jobs in rows:
        counted[int(priority)] = counted.get(int(priority), 0) + int(jobs)
    return counted


def queued_by_priority(session: Session) -> dict[int, int]:
    """{priority: jobs queued}, counted over the queue itself (the recount's truth)."""
    rows = session.execute(
        select(Job.priority, func.count()).where(Job.state == JobState.QUEUED.value).group_by(Job.priority)
    ).all()
    return {int(priority): int(n) for priority, n in rows}


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


# -- one job, as its writers read it -------------------------------------------------------------


def job_by_id(session: Session, job_id: int) -> Job | None:
    """By primary key: the session's own copy when it holds one already (then no query)."""
    return session.get(Job, job_id)


def owner_of(session: Session, job_id: int) -> int | None:
    return session.execute(select(Job.owner_id).where(Job.id == job_id)).scalar_one_or_none()


def state_of(session: Session, job_id: int) -> str | None:
    """The job's state alone (None: no such job), without loading its row."""
    return session.execute(select(Job.state).where(Job.id == job_id)).scalar_one_or_none()


def visible_job_id(session: Session, job_id: int | None, owner_id: int | None) -> int | None:
    """The job's id when it exists and is `owner_id`'s (None: any owner's, the admin's view)."""
    clause = [] if owner_id is None else [Job.owner_id == owner_id]
    return session.execute(select(Job.id).where(Job.id == job_id, *clause)).scalar_one_or_none()


def states_and_owners(session: Session, job_ids: list[int]) -> dict[int, Row[int, str, int]]:
    """(id, state, owner_id) of each of these jobs that exists."""
    query = select(Job.id, Job.state, Job.owner_id).where(Job.id.in_(job_ids))
    return {r.id: r for r in session.execute(query)}


def control(session: Session, job_id: int) -> Row[str, int, datetime | None, str | None, int | None] | None:
    """(state, attempt, last_report_at, stop_intent): what a node's supervisor looks at."""
    return session.execute(
        select(Job.state, Job.attempt, Job.last_report_at, Job.stop_intent, STOP_GRACE).where(
            Job.id == job_id
        )
    ).one_or_none()


# contract §12: the job's `stop_grace_s` while a preemption (or a drain) stops its attempt, at most
# LOST_NODE_GRACE_S when an elastic job restarts without a lost node (its peers' collectives
# cannot finish: nothing is gained by waiting), else NULL
LOST_NODE = "node lost"  # an elastic job's `resize_reason` (service.jobs.elastic)
NODE_FAILED = "node failed"  # ... while it is not yet known whether a node failed or was lost
SHORT_STOPS = (LOST_NODE, NODE_FAILED)
LOST_NODE_GRACE_S = 10
STOP_GRACE = case(
    (
        Job.preempting_since.is_not(None),
        case(
            (
                and_(Job.resize_reason.in_(SHORT_STOPS), Job.stop_grace_s > LOST_NODE_GRACE_S),
                LOST_NODE_GRACE_S,
            ),
            else_=Job.stop_grace_s,
        ),
    ),
    else_=None,
).label("stop_grace_s")


def set_progress(session: Session, job_id: int, progress: dict[str, Any]) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(progress=progress))


def stop_grace_of(
    preempting_since: datetime | None, stop_grace_s: int, resize_reason: str | None = None
) -> int | None:
    """STOP_GRACE, in Python: the job's grace while a stop is asked of its attempt, else None."""
    if preempting_since is None:
        return None
    return min(stop_grace_s, LOST_NODE_GRACE_S) if resize_reason in SHORT_STOPS else stop_grace_s


def touch_last_report(
    session: Session, job_id: int, attempt: int, now: datetime, stale_before: datetime
) -> Row[str, int, datetime | None, str | None, datetime | None, int, str | None] | None:
    """`last_report_at = now` on the job's `attempt` when it is older than `stale_before` (or
    unset); (state, attempt, last_report_at, stop_intent) when written, None when not."""
    return session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.attempt == attempt,
            or_(Job.last_report_at.is_(None), Job.last_report_at < stale_before),
        )
        .values(last_report_at=now)
        # plain columns only: SQLite 3.40's RETURNING evaluates `x IS NULL` wrongly (true of
        # a NULL column's IS NOT NULL); the grace is worked out in Python (`stop_grace_of`)
        .returning(
            Job.state,
            Job.attempt,
            Job.last_report_at,
            Job.stop_intent,
            Job.preempting_since,
            Job.stop_grace_s,
            Job.resize_reason,
        )
        .execution_options(synchronize_session=False)
    ).one_or_none()


def add_log_chunks(session: Session, chunks: Iterable[LogChunk]) -> None:
    session.add_all(chunks)


# -- attempts and node runs ----------------------------------------------------------------------


def attempt_of(session: Session, job_id: int, attempt: int) -> JobAttempt | None:
    return session.execute(
        select(JobAttempt).where(JobAttempt.job_id == job_id, JobAttempt.attempt == attempt)
    ).scalar_one_or_none()


def add_attempt(session: Session, row: JobAttempt) -> None:
    session.add(row)


def earlier_attempt_times(
    session: Session, job_id: int, attempt: int
) -> Sequence[Row[datetime | None, datetime | None]]:
    """(started_at, finished_at) of each of the job's attempts before `attempt`."""
    return session.execute(
        select(JobAttempt.started_at, JobAttempt.finished_at).where(
            JobAttempt.job_id == job_id, JobAttempt.attempt < attempt
        )
    ).all()


def runs_of(session: Session, job_id: int, attempt: int) -> Sequence[NodeRun]:
    return (
        session.execute(
            select(NodeRun)
            .where(NodeRun.job_id == job_id, NodeRun.attempt == attempt)
            .order_by(NodeRun.node_rank)
        )
        .scalars()
        .all()
    )


def set_job_address(session: Session, job_id: int, attempt: int, node_rank: int, address: str) -> None:
    session.execute(
        update(NodeRun)
        .where(NodeRun.job_id == job_id, NodeRun.attempt == attempt, NodeRun.node_rank == node_rank)
        .values(job_address=address)
    )


def job_addresses(session: Session, job_id: int, attempt: int) -> list[tuple[int, str, str | None]]:
    """(node rank, its worker host's address, its own job address) for every node of the attempt."""
    rows = session.execute(
        select(NodeRun.node_rank, NodeRun.address, NodeRun.job_address)
        .where(NodeRun.job_id == job_id, NodeRun.attempt == attempt)
        .order_by(NodeRun.node_rank)
    ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def node_states(session: Session, job_id: int, attempt: int) -> list[str]:
    """The state of each node of the attempt, in no order: whether every one has ended."""
    return list(
        session.execute(
            select(NodeRun.state).where(NodeRun.job_id == job_id, NodeRun.attempt == attempt)
        ).scalars()
    )


def node_run(session: Session, job_id: int, attempt: int, node_rank: int) -> NodeRun | None:
    return session.execute(
        select(NodeRun).where(
            NodeRun.job_id == job_id, NodeRun.attempt == attempt, NodeRun.node_rank == node_rank
        )
    ).scalar_one_or_none()


def node_runs_by_ids(session: Session, run_ids: list[int]) -> Sequence[NodeRun]:
    return session.execute(select(NodeRun).where(NodeRun.id.in_(run_ids))).scalars().all()


def add_node_run(session: Session, run: NodeRun) -> None:
    session.add(run)


def peer_ends(
    session: Session, job_id: int, attempt: int, node_rank: int
) -> Sequence[Row[str, datetime | None]]:
    """(state, finished_at) of the attempt's nodes other than `node_rank`."""
    return session.execute(
        select(NodeRun.state, NodeRun.finished_at).where(
            NodeRun.job_id == job_id,
            NodeRun.attempt == attempt,
            NodeRun.node_rank != node_rank,
        )
    ).all()


# -- dependencies --------------------------------------------------------------------------------


def add_dependency_rows(session: Session, rows: Iterable[JobDependency]) -> None:
    session.add_all(rows)


def dependencies_of(session: Session, job_ids: list[int]) -> list[Row[int, int, str, str]]:
    """(job_id, depends_on_id, condition, the state of the job depended on) of every
    dependency of these queued jobs. Read as the dependencies of every queued job, then kept
    for `job_ids`: a scheduling pass asks for thousands, and an IN list of that many bound
    values cost more than the query (most queued jobs have no dependency)."""
    wanted = set(job_ids)
    dependent = aliased(Job)
    rows = session.execute(
        select(JobDependency.job_id, JobDependency.depends_on_id, JobDependency.condition, Job.state)
        .join(Job, Job.id == JobDependency.depends_on_id)
        .join(dependent, dependent.id == JobDependency.job_id)
        .where(dependent.state == JobState.QUEUED.value)
        .order_by(JobDependency.job_id, JobDependency.depends_on_id)
    ).all()
    return [row for row in rows if row.job_id in wanted]


def dependants_needing_success(session: Session, job_id: int) -> list[int]:
    """The jobs whose dependency on `job_id` has the condition 'succeeded', in id order (every
    writer locks jobs in id order: no deadlock cycle)."""
    return list(
        session.execute(
            select(JobDependency.job_id)
            .where(JobDependency.depends_on_id == job_id, JobDependency.condition == "succeeded")
            .order_by(JobDependency.job_id)
        ).scalars()
    )


# -- sweeps --------------------------------------------------------------------------------------

_LIVE_SWEEP = (
    select(Job.id).where(Job.kind == SWEEP, Job.state.in_((JobState.RUNNING, JobState.CANCELLING))).limit(1)
)


def child_ids(session: Session, parent_id: int, exclude: frozenset[JobState] = frozenset()) -> list[int]:
    query = select(Job.id).where(Job.parent_id == parent_id).order_by(Job.id)
    if exclude:
        query = query.where(Job.state.not_in(list(exclude)))
    return list(session.execute(query).scalars())


def state_counts(session: Session, parent_ids: list[int]) -> dict[int, dict[str, int]]:
    """How many children of each parent are in each state."""
    rows = session.execute(
        select(Job.parent_id, Job.state, func.count())
        .where(Job.parent_id.in_(parent_ids))
        .group_by(Job.parent_id, Job.state)
    ).all()
    counts: dict[int, dict[str, int]] = {}
    for parent_id, state, n in rows:
        if parent_id is not None:  # (the query asks for none)
            counts.setdefault(parent_id, {})[state] = int(n)
    return counts


def any_live_sweep(session: Session) -> bool:
    """Whether a sweep's parent is running or cancelling."""
    return session.execute(_LIVE_SWEEP).first() is not None


def live_sweeps(session: Session) -> Sequence[Row[int, dict[str, Any] | None]]:
    """(id, progress) of every sweep parent running or cancelling."""
    return session.execute(
        select(Job.id, Job.progress).where(
            Job.kind == SWEEP, Job.state.in_((JobState.RUNNING, JobState.CANCELLING))
        )
    ).all()


def unsucceeded_children(session: Session, parent_id: int) -> Sequence[Row[int, str]]:
    """(id, state) of the parent's children that did not succeed, in id order."""
    return session.execute(
        select(Job.id, Job.state)
        .where(Job.parent_id == parent_id, Job.state != JobState.SUCCEEDED)
        .order_by(Job.id)
    ).all()


def sweep_specs(session: Session, parent_ids: set[int]) -> Sequence[Row[int, dict[str, Any] | None]]:
    """(id, sweep) of these parents."""
    return session.execute(select(Job.id, Job.sweep).where(Job.id.in_(parent_ids))).all()


def active_children(session: Session, parent_ids: list[int]) -> Sequence[Row[int | None, int]]:
    """(parent_id, how many of its children hold or may hold GPUs: active) per parent."""
    return session.execute(
        select(Job.parent_id, func.count())
        .where(Job.parent_id.in_(parent_ids), Job.state.in_(list(JOB_ACTIVE)))
        .group_by(Job.parent_id)
    ).all()


# -- the scheduler's reads -----------------------------------------------------------------------

# Five columns of each active node, not whole rows: with a thousand hosts the reaper runs every
# second (bench/scale.py).
_ACTIVE_RUNS = select(
    NodeRun.id,
    NodeRun.worker_name,
    NodeRun.state,
    NodeRun.worker_session,
    NodeRun.created_at,
    NodeRun.node_rank,
).where(NodeRun.state.in_(NODE_ACTIVE))


def active_runs(session: Session) -> Sequence[Row[int, str, str, str | None, datetime, int]]:
    """(id, worker_name, state, worker_session, created_at, node_rank) of every active node."""
    return session.execute(_ACTIVE_RUNS).all()


def cancelling_jobs(session: Session) -> Sequence[Job]:
    """Jobs (not sweep parents: `settle_sweeps` ends those) being cancelled."""
    query = select(Job).where(Job.state == JobState.CANCELLING, Job.kind != SWEEP)
    return session.execute(query).scalars().all()


def pending_runs_before(session: Session, cutoff: datetime) -> Sequence[NodeRun]:
    """Nodes placed before `cutoff` that no worker has claimed yet."""
    return (
        session.execute(
            select(NodeRun).where(NodeRun.state == NodeState.PENDING, NodeRun.created_at < cutoff)
        )
        .scalars()
        .all()
    )


def any_job_in(session: Session, states: tuple[str, ...]) -> bool:
    return session.execute(select(Job.id).where(Job.state.in_(states)).limit(1)).first() is not None


def any_running_sweep(session: Session) -> bool:
    live = select(Job.id).where(Job.kind == SWEEP, Job.state == JobState.RUNNING).limit(1)
    return session.execute(live).first() is not None


def any_pending_node(session: Session) -> bool:
    query = select(NodeRun.id).where(NodeRun.state == NodeState.PENDING).limit(1)
    return session.execute(query).first() is not None


def master_ports(session: Session) -> Sequence[Row[str, int | None]]:
    """(worker_name, master_port) of the rank-0 node of every active job that has a port."""
    return session.execute(
        select(NodeRun.worker_name, Job.master_port)
        .join(Job, (Job.id == NodeRun.job_id) & (Job.attempt == NodeRun.attempt))
        .where(Job.state.in_(JOB_ACTIVE), NodeRun.node_rank == 0, Job.master_port.is_not(None))
    ).all()


def set_pending_reasons(session: Session, changed: list[dict[str, Any]]) -> None:
    """One bulk UPDATE by primary key: `changed` is [{"id": .., "pending_reason": ..}]."""
    session.execute(update(Job), changed)


# -- preemption (contract §12) -------------------------------------------------------------------


def stopping_jobs(session: Session) -> list[Job]:
    """Scheduled or running jobs whose attempt is being stopped: the reaper looks at whether
    their nodes have all ended. Locked and read afresh (a job another transaction holds is left
    to the next pass): the last node's end may settle the job in an API process meanwhile, and
    the reaper settling its stale copy a second time queued it twice (two `state` events, and
    the queue's count, `service.jobs.queue_counts`, one too high for good)."""
    query = (
        select(Job)
        .where(Job.preempting_since.is_not(None), Job.state.in_((JobState.SCHEDULED, JobState.RUNNING)))
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    )
    return list(session.execute(query).scalars())


def owner_ids(session: Session, job_ids: set[int]) -> dict[int, int]:
    """{job id: owner id} of these jobs that exist: who may see a preemptor's id."""
    query = select(Job.id, Job.owner_id).where(Job.id.in_(job_ids))
    return {r.id: r.owner_id for r in session.execute(query)}


# -- metric series (contract §13), written under the job's row lock that the report took ------


def objective_facts(
    session: Session, job_id: int
) -> Row[int | None, dict[str, Any] | None, str | None] | None:
    """(parent_id, objective, stop_intent): what a report's metrics are recorded against."""
    return session.execute(
        select(Job.parent_id, Job.objective, Job.stop_intent).where(Job.id == job_id)
    ).one_or_none()


def add_metric_points(session: Session, rows: list[dict[str, Any]]) -> None:
    """One bulk INSERT (executemany): a batch's points, as `metric_points` column dicts."""
    session.execute(insert(MetricPoint), rows)


def set_objective_value(session: Session, job_id: int, value: float, epoch: int | None) -> None:
    """A sweep child's last objective onto its own row, where the sweep's best is read from;
    `synchronize_session=False`: the session's copy of the job is not refreshed (none reads it)."""
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(objective_value=value, objective_epoch=epoch)
        .execution_options(synchronize_session=False)
    )


def known_metric_names(session: Session, job_id: int) -> set[str]:
    """The job's names, unordered: only a new name is inserted."""
    return set(session.execute(select(MetricName.name).where(MetricName.job_id == job_id)).scalars())


def add_metric_names(session: Session, job_id: int, names: list[str]) -> None:
    session.execute(insert(MetricName), [{"job_id": job_id, "name": n} for n in names])


def metric_names(session: Session, job_id: int) -> list[str]:
    """The job's names, sorted: the series answer lists them so."""
    return list(
        session.execute(
            select(MetricName.name).where(MetricName.job_id == job_id).order_by(MetricName.name)
        ).scalars()
    )


def metric_points_as_text(session: Session, job_id: int) -> Result[int | None, int | None, datetime, str]:
    """(step, epoch, ts, values as JSON text) of each point in report order, as a result that
    is iterated, not a list: the stored JSON is spliced into the answer, never parsed."""
    return session.execute(
        select(MetricPoint.step, MetricPoint.epoch, MetricPoint.ts, cast(MetricPoint.values, Text))
        .where(MetricPoint.job_id == job_id)
        .order_by(MetricPoint.seq)
    )


def extracted_metric_points(session: Session, job_id: int, names: list[str]) -> Result[*tuple[Any, ...]]:
    """(step, epoch, ts, value of each name...) of the points holding one of `names`, in report
    order: the database picks the values out of each point's JSON (`->>`, `json_extract`)."""
    columns = [MetricPoint.values[name].as_float() for name in names]
    return session.execute(
        select(MetricPoint.step, MetricPoint.epoch, MetricPoint.ts, *columns)
        .where(MetricPoint.job_id == job_id, or_(*(c.is_not(None) for c in columns)))
        .order_by(MetricPoint.seq)
    )


# A point as the series answer writes it, built by PostgreSQL: `ts` as Python's isoformat()
# of an aware UTC datetime (no fraction when it is zero), each name present as `,"name":value`
# with the value's number as jsonb keeps it (as the whole read splices it: 1e300 in full
# digits). `:key_N` is the name already JSON-encoded, `:name_N` the name itself; both bound,
# never spliced into the SQL.
_PG_TS = """to_char(ts AT TIME ZONE 'UTC',
    CASE WHEN mod(extract(microseconds FROM ts)::bigint, 1000000) = 0
    THEN 'YYYY-MM-DD"T"HH24:MI:SS' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US' END)"""
_PG_POINT = f"""'{{"step":' || coalesce(step::text, 'null') || ',"epoch":' || coalesce(epoch::text, 'null')
 || ',"ts":"' || {_PG_TS} || '+00:00"'"""


def series_text_pg(session: Session, job_id: int, names: list[str]) -> str:
    """PostgreSQL only: the answer's points holding one of `names`, joined by commas, built
    in one statement (one row back, not one a point, and no value parsed or formatted here)."""
    picks = " || ".join(f"coalesce(:key_{i} || (\"values\" ->> :name_{i}), '')" for i in range(len(names)))
    sql = (
        f"SELECT coalesce(string_agg({_PG_POINT} || {picks} || '}}', ',' ORDER BY seq), '') "
        'FROM metric_points WHERE job_id = :job_id AND jsonb_exists_any("values", CAST(:names AS text[]))'
    )
    params: dict[str, Any] = {"job_id": job_id, "names": names}
    for i, name in enumerate(names):
        params[f"name_{i}"] = name
        params[f"key_{i}"] = "," + json.dumps(name) + ":"
    return str(session.execute(text(sql), params).scalar_one())


# -- a sweep's objective and its rungs (ASHA, contract §13) -------------------------------------


def running_sweep_specs(session: Session) -> Sequence[Row[int, dict[str, Any] | None]]:
    """(id, sweep) of every running sweep parent: the scheduler pass reviews each."""
    return session.execute(
        select(Job.id, Job.sweep).where(Job.kind == SWEEP, Job.state == JobState.RUNNING)
    ).all()


def rungs_recorded(session: Session, parent_id: int) -> dict[int, int]:
    """{child id: how many rungs it has a value at} for the sweep's children."""
    rows = session.execute(
        select(SweepRung.child_id, func.count(SweepRung.rung))
        .where(SweepRung.parent_id == parent_id)
        .group_by(SweepRung.child_id)
    ).all()
    return {int(child_id): int(n) for child_id, n in rows}


def reporting_children(
    session: Session, parent_id: int
) -> Sequence[Row[int, int | None, dict[str, Any] | None]]:
    """(id, objective_epoch, hyperparameters) of the children not ended nor stopped that have
    reported their objective: the only ones that may have reached a rung."""
    return session.execute(
        select(Job.id, Job.objective_epoch, Job.hyperparameters).where(
            Job.parent_id == parent_id,
            Job.state.not_in(list(JOB_TERMINAL)),
            Job.stop_intent.is_(None),
            Job.objective_epoch.is_not(None),
        )
    ).all()


def sweep_child(
    session: Session, parent_id: int, child_id: int
) -> Row[int, dict[str, Any] | None, str | None, str] | None:
    """(id, hyperparameters, stop_intent, state) of the child, None unless it is this parent's."""
    return session.execute(
        select(Job.id, Job.hyperparameters, Job.stop_intent, Job.state).where(
            Job.id == child_id, Job.parent_id == parent_id
        )
    ).one_or_none()


def last_objective_epoch(session: Session, job_id: int) -> int | None:
    """The highest epoch at which the job reported its objective: how far up the rungs it got."""
    return session.execute(
        select(func.max(MetricPoint.epoch)).where(
            MetricPoint.job_id == job_id, MetricPoint.objective.is_not(None)
        )
    ).scalar()


def child_rungs(session: Session, parent_id: int, child_id: int) -> set[int]:
    """The rungs the child has a value at: each is recorded once (a retry does not vote twice)."""
    return set(
        session.execute(
            select(SweepRung.rung).where(SweepRung.parent_id == parent_id, SweepRung.child_id == child_id)
        ).scalars()
    )


def first_objective_at(session: Session, job_id: int, epoch: int) -> Row[int | None, float | None]:
    """(epoch, objective) of the job's first report of its objective at `epoch` or later: the
    value it completed that rung with (the caller knows one exists)."""
    return session.execute(
        select(MetricPoint.epoch, MetricPoint.objective)
        .where(
            MetricPoint.job_id == job_id,
            MetricPoint.objective.is_not(None),
            MetricPoint.epoch >= epoch,
        )
        .order_by(MetricPoint.seq)
        .limit(1)
    ).one()


def rung_values(session: Session, parent_id: int, rung: int) -> list[float]:
    """Every value recorded at the sweep's rung so far: what a new one is compared with."""
    return list(
        session.execute(
            select(SweepRung.value).where(SweepRung.parent_id == parent_id, SweepRung.rung == rung)
        ).scalars()
    )


def add_rung(
    session: Session, parent_id: int, rung: int, child_id: int, epoch: int, value: float, verdict: str
) -> None:
    """The child's value at the rung and its verdict (the caller holds the parent's row lock)."""
    session.execute(
        insert(SweepRung).values(
            parent_id=parent_id, rung=rung, child_id=child_id, epoch=epoch, value=value, verdict=verdict
        )
    )


def best_child(
    session: Session, parent_id: int, minimise: bool
) -> Row[int, dict[str, Any] | None, float | None] | None:
    """(id, sweep_point, objective_value) of the child with the best last value (ties: the
    lowest id), through the (parent_id, objective_value) index."""
    value = Job.objective_value
    return session.execute(
        select(Job.id, Job.sweep_point, value)
        .where(Job.parent_id == parent_id, value.is_not(None))
        .order_by(value.asc() if minimise else value.desc(), Job.id)
        .limit(1)
    ).one_or_none()


def growable_jobs(session: Session) -> Sequence[Job]:
    """Running elastic jobs below their most nodes and not being stopped (contract §12)."""
    query = select(Job).where(
        Job.state == JobState.RUNNING,
        Job.nodes_max.is_not(None),
        Job.nodes < Job.nodes_max,
        Job.preempting_since.is_(None),
    )
    return session.execute(query.order_by(Job.priority.desc(), Job.id)).scalars().all()


def top_queued_priority(session: Session) -> int | None:
    """The highest priority of a queued job, or None with none queued."""
    query = select(func.max(Job.priority)).where(Job.state == JobState.QUEUED, Job.kind != SWEEP)
    return session.execute(query).scalar_one_or_none()
