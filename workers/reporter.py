"""What a node writes to the database: log chunks and events in batches, checkpoints, its end.

One transaction per batch, however many lines or reports it holds: a burst of output is
coalesced, never one transaction per line.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from tenacity import before_sleep_log, retry, retry_if_exception_type, stop_after_delay, wait_exponential

from service.checkpoints import service as checkpoints_service
from service.db import Database
from service.jobs.lifecycle import NodeOutcome, finish_node
from service.jobs.schemas import PROGRESS_FIELDS
from service.jobs.states import append_attempt_events, append_event
from service.models import Checkpoint, Job, LogChunk
from service.notify import mark_logs
from service.schemas import checkpoint_out
from service.storage import Storage

log = logging.getLogger("torchjobs.worker")
MAX_CHUNK = 256 * 1024
END_WRITE_PATIENCE_S = 600.0  # as long as a database restart or fail-over may take


@dataclass
class Batch:
    logs: list[tuple[int, int, bytes]] = field(default_factory=list)  # (local_rank, offset, data)
    events: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.logs or self.events)


@dataclass(frozen=True, kw_only=True)
class NodeKey:
    job_id: int
    attempt: int
    node_rank: int


JobControl = tuple[str, int]  # the job's (state, attempt): what a supervisor acts on


class NodeConnection:
    """A running node's own database connection, kept from one look to the next.

    A connection taken from the pool is pinged first (on PostgreSQL a round trip of its own);
    a node stores a batch every half second, for hours, so it keeps one. A transaction that
    fails drops it, and the next look takes a fresh one from the pool: the supervisor keeps
    whatever could not be stored meanwhile."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.conn: Connection | None = None

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        if self.conn is None:
            self.conn = self.db.engine.connect()
        try:
            with self.db.sessionmaker(bind=self.conn) as session, session.begin():
                yield session
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a connection already broken
                conn.close()


def write_batch(db: Database | NodeConnection, key: NodeKey, batch: Batch) -> JobControl | None:
    """Log chunks and progress events of one look, in one transaction. Open streams hear of
    it after the commit (`service.notify`): the events through `append_event`, the log through
    `mark_logs`. The job's `progress` is written once per batch, with the latest values.

    Returns the job's (state, attempt) as that transaction saw it, or None when there was
    nothing to write or the job is gone: the supervisor takes it for its look at the job, so
    a node that is storing output costs the database one transaction a look, not two."""
    if not batch:
        return None
    with db.transaction() as session:
        if batch.logs:
            session.add_all(
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
            mark_logs(session, key.job_id)
        progress = [e for e in batch.events if e.get("type", "progress") == "progress"]
        if not progress:
            return _control(session, key.job_id)
        cleaned = [_clean(event) for event in progress]
        job = append_attempt_events(session, key.job_id, key.attempt, [("progress", d) for d in cleaned])
        if job is None:  # gone, or on another attempt: its reports are not this job's now
            return _control(session, key.job_id)
        latest = dict(job.progress or {})
        for data in cleaned:
            latest.update({k: data[k] for k in PROGRESS_FIELDS if k in data})
        if latest != job.progress:
            session.execute(update(Job).where(Job.id == key.job_id).values(progress=latest))
        return job.state, key.attempt


def _control(session: Session, job_id: int) -> JobControl | None:
    row = session.execute(select(Job.state, Job.attempt).where(Job.id == job_id)).one_or_none()
    return (row.state, row.attempt) if row else None


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


def record_checkpoint(
    db: Database, storage: Storage, key: NodeKey, path: Path, meta: dict[str, Any] | None, version: int = 0
) -> int | None:
    """Upload first (outside any transaction), then record the row and its event together.

    A name written again (`version` > 0) is stored beside the earlier files of that name, never
    over them: each is a Checkpoint of its own, downloadable and resumable."""
    folder = f"jobs/{key.job_id}/attempt-{key.attempt}" + (f"/v{version}" if version else "")
    storage_key = f"{folder}/{path.name}"
    size, sha = storage.put_file(str(path), storage_key)
    meta = meta or {}
    with db.transaction() as session:
        job = session.execute(select(Job).where(Job.id == key.job_id)).scalar_one_or_none()
        if job is None:
            storage.delete(storage_key)
            return None
        ckpt = Checkpoint(
            owner_id=job.owner_id,
            job_id=job.id,
            attempt=key.attempt,
            name=path.name,
            epoch=meta.get("epoch"),
            step=meta.get("step"),
            size_bytes=size,
            sha256=sha,
            storage_key=storage_key,
            metrics=meta.get("metrics") or {},
        )
        session.add(ckpt)
        session.flush()
        append_event(session, job.id, "checkpoint", checkpoint_out(ckpt).model_dump(mode="json"))
        ckpt_id = ckpt.id
    keep_last = db.settings.checkpoint_keep_last
    if keep_last:
        try:
            checkpoints_service.enforce_retention(db, storage, key.job_id, keep_last)
        except Exception:  # retention is housekeeping: it must never fail the recording
            log.exception("job %s: checkpoint retention failed", key.job_id)
    return ckpt_id


@retry(
    retry=retry_if_exception_type(DBAPIError),
    wait=wait_exponential(multiplier=0.2, max=10),
    stop=stop_after_delay(END_WRITE_PATIENCE_S),
    before_sleep=before_sleep_log(log, logging.WARNING),
    reraise=True,
)
def record_end(db: Database, key: NodeKey, outcome: NodeOutcome) -> None:
    """The node's end, retried while the database is away (restarting, locked, unreachable):
    if it were dropped the job would stay `running` on a live worker that no longer runs it.
    Idempotent: a node already ended keeps its first outcome."""
    with db.transaction() as session:
        finish_node(session, key.job_id, key.attempt, key.node_rank, outcome)


def job_control(db: Database, job_id: int) -> JobControl | None:
    """The job's (state, attempt), read without a lock: what a supervisor polls."""
    with db.sessionmaker() as session:
        return _control(session, job_id)
