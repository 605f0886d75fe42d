"""What a running node writes: log chunks and progress events, in one transaction per batch.

However many lines or reports a batch holds, it costs one transaction: a burst of output is
coalesced, never one transaction per line. Open streams hear of it after the commit
(`service.wakeups`): the events through `append_attempt_events`, the logs through `mark_logs`.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.orm import Session

from service.db import Database
from service.jobs import metrics
from service.jobs import repository as repo
from service.jobs.asha import EARLY_STOP, review_after_report
from service.jobs.schemas import PROGRESS_FIELDS
from service.jobs.states import append_attempt_events
from service.models import LogChunk, utcnow
from service.nodes.values import Batch, JobControl, NodeKey
from service.states import NODE_ACTIVE
from service.wakeups.message import mark_logs

MAX_CHUNK = 256 * 1024
REPORT_RESOLUTION = timedelta(seconds=2)  # how stale `last_report_at` may be: 2 s of a stall clock


class Transactions(Protocol):
    """A `Database`, or a node's own kept connection (`service.db.KeptConnection`)."""

    def transaction(self) -> AbstractContextManager[Session]: ...


def write_batch(db: Transactions, key: NodeKey, batch: Batch) -> JobControl | None:
    """Log chunks and progress events of one look, in one transaction. Open streams hear of
    it after the commit. The job's `progress` is written once per batch, with the latest values.

    Returns the job's (state, attempt) as that transaction saw it, or None when there was
    nothing to write or the job is gone: the supervisor takes it for its look at the job, so
    a node that is storing output costs the database one transaction a look, not two."""
    if not batch:
        return None
    with db.transaction() as session:
        if batch.logs:
            chunks = (
                LogChunk(
                    job_id=key.job_id,
                    attempt=key.attempt,
                    node_rank=key.node_rank,
                    local_rank=local_rank,
                    offset=offset + i,
                    data=data[i : i + MAX_CHUNK],
                )
                for local_rank, offset, data in batch.logs
                for i in range(0, len(data), MAX_CHUNK)
            )
            repo.add_log_chunks(session, chunks)
            mark_logs(session, key.job_id)
        progress = [e for e in batch.events if e.get("type", "progress") == "progress"]
        if not progress:
            return _control(session, key.job_id) if batch.stopping else touch_report(session, key)
        cleaned = [with_fraction(_clean(event)) for event in progress]
        job = append_attempt_events(
            session, key.job_id, key.attempt, [("progress", d) for d in cleaned], touch=not batch.stopping
        )
        if job is None:  # gone, or on another attempt: its reports are not this job's now
            return _control(session, key.job_id)
        latest = dict(job.progress or {})
        for data in cleaned:
            latest.update({k: data[k] for k in PROGRESS_FIELDS if k in data})
        if latest != job.progress:
            repo.set_progress(session, key.job_id, latest)
        first_seq = job.last_event_seq - len(cleaned) + 1
        recorded = metrics.record(session, key.job_id, key.attempt, first_seq, cleaned)
        grace = repo.stop_grace_of(job.preempting_since, job.stop_grace_s, job.resize_reason)  # §12
        control = JobControl(
            job.state, key.attempt, job.last_report_at, stop=recorded.stop_intent, stop_grace_s=grace
        )
    parent = recorded.parent_id if recorded.objective_moved else None
    if parent is not None and review_after_report(db, parent, key.job_id):  # an ASHA rung: stop (§13)
        return control._replace(stop=EARLY_STOP)
    return control


def touch_report(session: Session, key: NodeKey) -> JobControl | None:
    """A rank of the job's current attempt said something: its stall clock starts again
    (contract §8). The row is written at most every `REPORT_RESOLUTION_S` (each write wakes
    the job-view feed on PostgreSQL); the job is read back for the supervisor's look."""
    now = utcnow()
    row = repo.touch_last_report(session, key.job_id, key.attempt, now, now - REPORT_RESOLUTION)
    if row is None:
        return _control(session, key.job_id)
    grace = repo.stop_grace_of(row.preempting_since, row.stop_grace_s, row.resize_reason)
    return JobControl(row.state, row.attempt, row.last_report_at, stop=row.stop_intent, stop_grace_s=grace)


def node_event(db: Transactions, key: NodeKey, type_: str, data: dict[str, Any]) -> None:
    """One event of a node's own (its environment being built, then ready), for this attempt."""
    with db.transaction() as session:
        append_attempt_events(
            session, key.job_id, key.attempt, [(type_, {"node_rank": key.node_rank, **data})]
        )


def peers_ended_at(db: Database, key: NodeKey) -> datetime | None:
    """When the last of the attempt's other nodes ended, once every one of them has; None
    while any still runs (or the job has one node): a straggler's clock (contract §8)."""
    with db.sessionmaker() as session:
        rows = repo.peer_ends(session, key.job_id, key.attempt, key.node_rank)
    if not rows or any(r.state in NODE_ACTIVE or r.finished_at is None for r in rows):
        return None
    return max(r.finished_at for r in rows)


def _control(session: Session, job_id: int) -> JobControl | None:
    row = repo.control(session, job_id)
    if row is None:
        return None
    return JobControl(
        row.state, row.attempt, row.last_report_at, stop=row.stop_intent, stop_grace_s=row.stop_grace_s
    )


def _clean(event: dict[str, Any]) -> dict[str, Any]:
    """Keep JSON-safe scalars only; NaN and infinities become null. The rank's own wall clock
    ("ts", seconds since the epoch) is kept as "reported_at": the event's `ts` is when it was stored."""
    out: dict[str, Any] = {}
    for k, v in event.items():
        if k == "ts" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out["reported_at"] = v
            continue
        if k in ("type", "ts") or not isinstance(k, str):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k[:64]] = v[:1000] if isinstance(v, str) else v
    return out


def with_fraction(data: dict[str, Any]) -> dict[str, Any]:
    """A progress event carries every progress field of the contract, `fraction` too (the share
    of the job done, as the Job's `progress` shows it); a report's own number is kept."""
    if _number(data.get("fraction")) is not None:
        return data
    data["fraction"] = None
    for done, whole in (("step", "total_steps"), ("epoch", "epochs")):
        a, b = _number(data.get(done)), _number(data.get(whole))
        if a is not None and b is not None and b > 0:
            data["fraction"] = min(1.0, max(0.0, a / b))
            break
    return data


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def job_control(db: Database, job_id: int) -> JobControl | None:
    """The job's state, attempt and last report, read without a lock: what a supervisor polls."""
    with db.sessionmaker() as session:
        return _control(session, job_id)
