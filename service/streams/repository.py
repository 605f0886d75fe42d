"""All SQL of the live streams: a job's stream cursor, change marks for the poller, log bytes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.models import Job, LogChunk, NodeRun

LOG_ROWS_PER_QUERY = 256


@dataclass(frozen=True, slots=True)
class JobCursor:
    state: str
    attempt: int
    last_event_seq: int


@dataclass(frozen=True, slots=True)
class NodeRunEnd:
    state: str
    finished_at: datetime | None


def job_cursor(session: Session, job_id: int) -> JobCursor | None:
    row = session.execute(
        select(Job.state, Job.attempt, Job.last_event_seq).where(Job.id == job_id)
    ).one_or_none()
    return JobCursor(row.state, row.attempt, row.last_event_seq) if row else None


def change_marks(
    session: Session, job_ids: set[int], log_job_ids: set[int]
) -> tuple[dict[int, int], dict[int, int]]:
    """Per job, a number that grows with each new event, and one with each new log chunk."""
    events = {
        row.id: row.last_event_seq
        for row in session.execute(select(Job.id, Job.last_event_seq).where(Job.id.in_(job_ids)))
    }
    logs: dict[int, int] = {}
    if log_job_ids:
        rows = session.execute(
            select(LogChunk.job_id, func.max(LogChunk.id))
            .where(LogChunk.job_id.in_(log_job_ids))
            .group_by(LogChunk.job_id)
        )
        logs = {job_id: newest for job_id, newest in rows}
    return events, logs


def node_run_end(session: Session, job_id: int, attempt: int, node_rank: int) -> NodeRunEnd | None:
    row = session.execute(
        select(NodeRun.state, NodeRun.finished_at).where(
            NodeRun.job_id == job_id, NodeRun.attempt == attempt, NodeRun.node_rank == node_rank
        )
    ).one_or_none()
    return NodeRunEnd(row.state, row.finished_at) if row else None


def read_log(
    session: Session,
    *,
    job_id: int,
    attempt: int,
    node_rank: int,
    local_rank: int,
    offset: int,
    limit: int,
) -> tuple[bytes, int]:
    """Up to `limit` bytes of one rank's stream from byte `offset`: (bytes, the next offset).

    Chunks are contiguous slices of the stream. A chunk stored twice (a batch retried after
    its commit went through) is skipped where it overlaps; a hole, which only a lost batch could
    leave, is stepped over rather than waited on forever.
    """
    where = (
        LogChunk.job_id == job_id,
        LogChunk.attempt == attempt,
        LogChunk.node_rank == node_rank,
        LogChunk.local_rank == local_rank,
    )
    # The chunk holding byte `offset` starts at or before it: begin there.
    start = session.execute(
        select(func.max(LogChunk.offset)).where(*where, LogChunk.offset <= offset)
    ).scalar_one_or_none()
    scan_from = start if start is not None else offset
    pos = offset
    parts: list[bytes] = []
    size = 0
    while size < limit:
        rows = session.execute(
            select(LogChunk.offset, LogChunk.data)
            .where(*where, LogChunk.offset >= scan_from)
            .order_by(LogChunk.offset, LogChunk.id)
            .limit(LOG_ROWS_PER_QUERY)
        ).all()
        for chunk_offset, data in rows:
            end = chunk_offset + len(data)
            if end <= pos:
                continue
            if chunk_offset > pos:
                pos = chunk_offset  # a hole: nothing will ever fill it
            piece = bytes(data[pos - chunk_offset : pos - chunk_offset + (limit - size)])
            parts.append(piece)
            size += len(piece)
            pos += len(piece)
            if size >= limit:
                break
        if len(rows) < LOG_ROWS_PER_QUERY:
            break
        scan_from = rows[-1].offset + 1
    return b"".join(parts), pos
