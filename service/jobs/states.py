"""The one gate for job and node-run state (Prefect's orchestration habit, made small).

The state machines themselves (names and allowed moves) are in `service.states`. Here are
their only writers: `create_job()` (and `create_job_if()`, its one-statement form for
`POST /v1/jobs`) and `transition_job()` write `Job.state`: they check the move, stamp the
times, free the job's GPUs when it leaves them behind, count the job into or out of the
queue (`service.jobs.queue_counts`), and append the `state` event in the same transaction.
`transition_node()` writes `NodeRun.state`, and a node's first end wins. The API, the
scheduler, the workers and the tests all go through them; tests/test_state_gates.py fails
when another module writes a `state` column.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Column,
    ColumnDefault,
    ColumnElement,
    Connection,
    Integer,
    Row,
    Select,
    String,
    Table,
    bindparam,
    delete,
    insert,
    inspect,
    literal,
    select,
    true,
    update,
)
from sqlalchemy.orm import Session, make_transient_to_detached

from service.errors import Conflict
from service.jobs import repository as repo
from service.jobs.queue_counts import count_queue
from service.jobs.view_cache import WROTE
from service.models import GpuAllocation, Job, JobEvent, NodeRun, utcnow
from service.states import (
    JOB_ACTIVE,
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    JobState,
    NodeState,
    job_may_move,
    node_may_move,
)
from service.usage.accounting import held_seconds
from service.wakeups.message import mark_events, mark_freed
from service.webhooks.outbox import enqueue as enqueue_webhooks
from service.webhooks.outbox import enqueue_returned

QUEUED, SCHEDULED, RUNNING = JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING
SUCCEEDED, FAILED, CANCELLING, CANCELLED = (
    JobState.SUCCEEDED,
    JobState.FAILED,
    JobState.CANCELLING,
    JobState.CANCELLED,
)
TERMINAL, ACTIVE, TRANSITIONS = JOB_TERMINAL, JOB_ACTIVE, JOB_TRANSITIONS
ALL_STATES = tuple(JobState)


def can_transition(current: str, new: str, kind: str = "job") -> bool:
    return job_may_move(current, new, kind)


def lock_job(session: Session, job_id: int) -> Job | None:
    """Re-read a job under a row lock (SQLite: the BEGIN IMMEDIATE lock already serialises)."""
    return session.execute(
        select(Job).where(Job.id == job_id).with_for_update().execution_options(populate_existing=True)
    ).scalar_one_or_none()


def append_event(session: Session, job_id: int, type_: str, data: dict[str, Any]) -> JobEvent:
    """Allocate the next per-job `seq` in the database: no gaps, whoever writes."""
    return append_events(session, job_id, [(type_, data)])[0]


def append_events(session: Session, job_id: int, items: list[tuple[str, dict[str, Any]]]) -> list[JobEvent]:
    """Append several events with one `UPDATE … + n`: a batch of progress costs one row
    update, not one per report. The row lock it takes orders concurrent writers."""
    if not items:
        return []
    last = session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(last_event_seq=Job.last_event_seq + len(items))
        .returning(Job.last_event_seq)
        .execution_options(synchronize_session=False)
    ).scalar_one()
    return _add_events(session, job_id, last, items)


def append_attempt_events(
    session: Session,
    job_id: int,
    attempt: int,
    items: list[tuple[str, dict[str, Any]]],
    touch: bool = False,
) -> Row[tuple[int, str, dict[str, Any] | None, datetime | None]] | None:
    """`append_events` for one attempt of the job, or nothing: one statement allocates the
    `seq`s, takes the row lock and returns the job's (last_event_seq, state, progress), where
    a lock, a check and an update took three. None, with nothing appended, when the job is
    gone or has moved on to another attempt. `touch`: the ranks reported, and the job's
    `last_report_at` (its stall clock, contract §8) moves in the same statement."""
    values: dict[str, Any] = {"last_event_seq": Job.last_event_seq + len(items)}
    if touch:
        values["last_report_at"] = utcnow()
    row = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt)
        .values(**values)
        .returning(
            Job.last_event_seq,
            Job.state,
            Job.progress,
            Job.last_report_at,
            Job.preempting_since,
            Job.stop_grace_s,
            Job.resize_reason,
        )
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if row is not None:
        _add_events(session, job_id, row.last_event_seq, items)
    return row


_INSERT_EVENT = insert(JobEvent)


def _add_events(
    session: Session,
    job_id: int,
    last: int,
    items: list[tuple[str, dict[str, Any]]],
    *,
    watched: bool = True,
) -> list[JobEvent]:
    """The rows go in through Core, on the session's connection: an event is never changed
    after it is written, so the unit of work's bookkeeping (a third of a submit's CPU with it)
    buys nothing. The objects returned are not in the session. `watched=False`: no stream
    can be open on the job yet, so no wake-up is published for these."""
    now = utcnow()
    first = last - len(items) + 1
    events = [
        JobEvent(job_id=job_id, seq=first + i, ts=now, type=type_, data=data)
        for i, (type_, data) in enumerate(items)
    ]
    session.connection().execute(
        _INSERT_EVENT,
        [{"job_id": job_id, "seq": e.seq, "ts": now, "type": e.type, "data": e.data} for e in events],
    )
    enqueue_webhooks(session, job_id, events)  # contract §10: the outbox, in this transaction
    if watched:
        mark_events(session, job_id)
    return events


def create_job(session: Session, job: Job, reason: str = "submitted") -> JobEvent:
    """A new job enters the machine queued, with its first `state` event."""
    _enter_queue(job)
    session.add(job)
    session.flush()
    count_queue(session, job.priority, +1, repo.NEW)
    # (a job that did not exist before this transaction has no open stream to wake: a stream
    # of an unknown job is a 404)
    first = [("state", {"state": job.state, "reason": reason})]
    return _add_events(session, job.id, 1, first, watched=False)[0]


def _enter_queue(job: Job) -> datetime:
    now = utcnow()
    job.state = JobState.QUEUED.value
    job.created_at = job.queued_at = now
    job.last_event_seq = 1  # its first event's, written with the row: no `UPDATE … + 1`
    return now


@dataclass(frozen=True, eq=False)
class WriteGuard:
    """A condition a write is made under, in its own statement, with bind parameters: that
    what the writer checked from a copy kept between requests still holds (the statements
    built with it are built once: one guard, one module-level constant)."""

    clause: ColumnElement[bool]


def create_job_if(
    session: Session, job: Job, guard: WriteGuard, params: dict[str, Any], reason: str = "submitted"
) -> int | None:
    """`create_job`, where `guard` holds, through Core; returns the job's queue position.

    On PostgreSQL one statement bumps the queue's count at the job's priority, inserts the
    row, its first event and its webhook deliveries, and answers the position: one round trip
    and no unit of work (the ORM's flush of the row was a sixth of a submit's CPU). SQLite,
    where one writer runs at a time, runs the same steps one statement each. The count's row
    lock is taken before the job's id is drawn, so among jobs of one priority ids follow the
    order of the bumps and a new job never counts one created after it. When `guard` does not
    hold nothing is written and None is returned. The job is then in the session as if loaded."""
    now = _enter_queue(job)
    row = _row_of(job)
    bound = {**row, **params, "event_ts": now, "event_data": {"state": job.state, "reason": reason}}
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        made = conn.execute(_pg_create(guard), bound).one_or_none()
        created = None if made is None else (int(made.id), int(made.position))
    else:
        created = _create_one_by_one(session, conn, guard, bound)
    if created is None:
        return None
    job.id = created[0]
    make_transient_to_detached(job)
    session.add(job)  # persistent, clean: no flush writes it again
    session.info[WROTE] = True  # (the view cache's commit hook sees no ORM write here)
    return created[1]


_JOB_COLUMNS = tuple(c for c in typing.cast(Table, Job.__table__).columns if not c.primary_key)


def _row_of(job: Job) -> dict[str, Any]:
    """Every column's value, each default the unit of work would have applied set on the job
    as well: the job is then complete, and reading any attribute of it costs no query."""
    loaded = inspect(job).dict
    for column in _JOB_COLUMNS:
        if column.key not in loaded:
            setattr(job, column.key, _default_of(column))
    return {column.key: loaded[column.key] for column in _JOB_COLUMNS}


def _default_of(column: Column[Any]) -> Any:
    """The Python-side default the unit of work would insert (a callable's is called anew)."""
    default = column.default
    if not isinstance(default, ColumnDefault):
        return None
    # (SQLAlchemy wraps a callable that takes no argument in one that takes a context)
    return default.arg(None) if default.is_callable else default.arg  # type: ignore[arg-type]


def _bump_new(dialect: str, guard: WriteGuard) -> Any:
    """The "new" count at `:priority` plus one, RETURNING it: a row proposed only where the
    guard holds (nothing at all is written otherwise)."""
    proposed = select(bindparam("priority", type_=Integer), literal(repo.NEW, String), literal(1, Integer))
    stmt = repo.counts_insert(dialect).from_select(
        ["priority", "source", "jobs"], proposed.where(guard.clause)
    )
    return repo.adding_on_conflict(stmt, 1).returning(repo.QUEUE_COUNTS.c.jobs)


# A JSON column's None is SQL NULL, as the unit of work leaves a column it was given no value
# for (JSON's own bind writes the JSON text `null`, which `IS NULL` does not find)
_JOB_VALUES = [
    bindparam(c.key, type_=JSON(none_as_null=True) if isinstance(c.type, JSON) else c.type)
    for c in _JOB_COLUMNS
]
_EVENT_TS = bindparam("event_ts", type_=JobEvent.ts.type)
_EVENT_DATA = bindparam("event_data", type_=JobEvent.data.type)


@functools.cache
def _pg_create(guard: WriteGuard) -> Select[tuple[int, int]]:
    """The job's row selects FROM the bump, so its id is drawn after the count's row lock."""
    bumped = _bump_new("postgresql", guard).cte("bumped")
    job = (
        insert(Job)
        .from_select([c.key for c in _JOB_COLUMNS], select(*_JOB_VALUES).select_from(bumped))
        .returning(Job.id, Job.owner_id)
        .cte("job")
    )
    first = (
        insert(JobEvent)
        .from_select(
            ["job_id", "seq", "ts", "type", "data"],
            select(job.c.id, literal(1, Integer), _EVENT_TS, literal("state", String), _EVENT_DATA),
        )
        .returning(JobEvent.job_id, JobEvent.seq, JobEvent.type)
        .cte("first_event")
    )
    deliveries = enqueue_returned(first, job.c.owner_id, _EVENT_TS).cte("deliveries")
    position = bumped.c.jobs + repo.QUEUED_ABOVE_BUT_NEW.scalar_subquery()
    return (
        select(job.c.id, position.label("position"))
        .select_from(job)
        .join(bumped, true())
        .add_cte(first, deliveries)
    )


@functools.cache
def _sqlite_bump(guard: WriteGuard) -> Any:
    return _bump_new("sqlite", guard)


_INSERT_JOB = (
    insert(Job).values(dict(zip([c.key for c in _JOB_COLUMNS], _JOB_VALUES, strict=True))).returning(Job.id)
)


def _create_one_by_one(
    session: Session, conn: Connection, guard: WriteGuard, bound: dict[str, Any]
) -> tuple[int, int] | None:
    bumped = conn.execute(_sqlite_bump(guard), bound).scalar_one_or_none()
    if bumped is None:
        return None
    job_id = int(conn.execute(_INSERT_JOB, bound).scalar_one())
    _add_events(session, job_id, 1, [("state", bound["event_data"])], watched=False)
    return job_id, int(bumped) + repo.queued_above_but_new(conn, bound["priority"])


def transition_job(session: Session, job: Job, new_state: str, reason: str | None = None) -> JobEvent:
    if not can_transition(job.state, new_state, job.kind or "job"):
        raise Conflict(f"job {job.id} cannot go from {job.state} to {new_state}")
    now = utcnow()
    new_state = JobState(new_state).value
    if (job.state == QUEUED) != (new_state == QUEUED):
        count_queue(session, job.priority, +1 if new_state == QUEUED else -1)
    job.state = new_state
    if new_state == RUNNING and job.started_at is None:
        job.started_at = now
    if new_state in TERMINAL:
        job.finished_at = now
        job.pending_reason = None
    if new_state == QUEUED:
        job.queued_at = now
        job.master_port = None
    if new_state in TERMINAL or new_state == QUEUED:
        free_gpus(session, job.id)
        _close_attempt(session, job, reason)
    session.flush()
    return append_event(session, job.id, "state", {"state": new_state, "reason": reason})


def free_gpus(session: Session, job_id: int) -> None:
    session.execute(delete(GpuAllocation).where(GpuAllocation.job_id == job_id))
    mark_freed(session)


def _close_attempt(session: Session, job: Job, reason: str | None) -> None:
    attempt = repo.attempt_of(session, job.id, job.attempt)
    if attempt is not None and attempt.finished_at is None:
        attempt.finished_at = utcnow()
        attempt.exit_code = job.exit_code
        attempt.reason = reason or job.state
        if attempt.started_at is not None:  # contract §9: every attempt counts, failed ones too
            attempt.gpu_seconds = held_seconds(attempt.started_at, attempt.finished_at, attempt.gpus)


def transition_node(
    run: NodeRun,
    new_state: NodeState,
    *,
    exit_code: int | None = None,
    error: str | None = None,
    worker_session: str | None = None,
) -> bool:
    """Move one node run; False, changing nothing, when the move is not allowed: a node that
    has ended keeps its first end, whoever reports later (a retried report, the reaper)."""
    if not node_may_move(run.state, new_state):
        return False
    now = utcnow()
    run.state = NodeState(new_state).value
    if run.state == NodeState.RUNNING:
        run.started_at, run.worker_session = now, worker_session
    else:
        run.exit_code, run.error, run.finished_at = exit_code, error, now
    return True
