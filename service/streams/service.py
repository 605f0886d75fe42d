"""Live streams of a job: its events and one rank's log, as async iterators the router sends.

Each stream loops: arm its watch, read what is new in a short read-only transaction on a worker
thread, send it, then wait for a wake-up (`service.wakeups`) or the recheck timer. No stream
holds a session while it waits, and the database decides what is sent: events with a `seq`
greater than the last one sent, log bytes from the stream's offset on.

Streams that wait on the same job at the same position share one read (`StreamReader`), so a
wake-up with two hundred streams open costs one read, not two hundred.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import anyio
from sqlalchemy.orm import Session

from service.config import Settings
from service.db import Database
from service.errors import InvalidSpec
from service.jobs import preemption
from service.jobs import repository as jobs_repo
from service.jobs.schemas import EventOut
from service.jobs.states import TERMINAL
from service.models import Job, utcnow
from service.states import NODE_ACTIVE, NodeState
from service.streams import repository as repo
from service.wakeups.hub import PollSource, RedisSource, Source, WakeupHub, WakeupService
from service.wakeups.message import is_redis

T = TypeVar("T")
EVENTS_PER_READ = 500
LOG_MESSAGE_BYTES = 256 * 1024
MAX_POSITION = 2**62
# A node whose run was ended by someone else (another node failed, the attempt was superseded)
# may still be flushing its last output: its supervisor notices within a second, stops its
# ranks within the cancel grace period, then stores what is left.
LOST_NODE_SETTLE_EXTRA_S = 5.0
NODE_OWN_ENDS = frozenset({NodeState.SUCCEEDED, NodeState.FAILED, NodeState.CANCELLED})


@dataclass(frozen=True, slots=True)
class EventItem:
    seq: int
    type: str
    json: str  # the whole event object {"seq","ts","type","data"}
    terminal: bool


@dataclass(frozen=True, slots=True)
class EventPage:
    events: tuple[EventItem, ...]
    ended: bool  # the job was already terminal before these events were read
    full: bool  # there may be more right away


@dataclass(frozen=True, slots=True)
class LogPage:
    data: bytes
    next_offset: int
    attempt: int


@dataclass(frozen=True, slots=True)
class LogPiece:
    offset: int
    next_offset: int
    text: str


@dataclass(frozen=True, slots=True)
class LogEnd:
    offset: int
    attempt: int
    state: str | None


@dataclass(frozen=True, slots=True)
class _LogSnapshot:
    complete: bool  # nothing more will be stored for this rank and attempt
    state: str | None
    data: bytes
    next_offset: int


class StreamReader:
    """Database reads for streams: on worker threads, at most `stream_read_concurrency` at once
    (the rest of the API keeps its threads), and shared between streams at the same place."""

    def __init__(self, db: Database, settings: Settings, hub: WakeupHub) -> None:
        self.db, self.hub = db, hub
        self.limiter = anyio.CapacityLimiter(settings.stream_read_concurrency)
        self._inflight: dict[tuple[int, int], tuple[int, asyncio.Future[EventPage]]] = {}

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def events(self, job_id: int, after: int, armed: int) -> EventPage:
        """Events after `after`, for a stream whose watch was armed at version `armed`. A read
        already under way is shared when it began at that version or later (see WakeupHub):
        one read per wake-up, however many streams it woke."""
        key = (job_id, after)
        entry = self._inflight.get(key)
        if entry is None or entry[0] < armed:
            began = self.hub.version(job_id)
            task = asyncio.ensure_future(self.run(self._read_events, job_id, after))
            entry = (began, task)
            self._inflight[key] = entry
            task.add_done_callback(functools.partial(self._done, key, entry))
        return await asyncio.shield(entry[1])

    def _done(self, key: tuple[int, int], entry: tuple[int, Any], task: asyncio.Future[Any]) -> None:
        if self._inflight.get(key) is entry:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone

    def _read_events(self, job_id: int, after: int) -> EventPage:
        with self.db.read() as session:
            # The job's state first: if it is terminal now, its terminal event is committed and
            # the read below sees it (or it was sent already).
            cursor = repo.job_cursor(session, job_id)
            if cursor is None:
                return EventPage((), ended=True, full=False)
            rows = jobs_repo.events_after(session, job_id, after, EVENTS_PER_READ)
            outs = preemption.redact(session, None, job_id, [EventOut.model_validate(e) for e in rows])
            items = tuple(
                EventItem(
                    seq=e.seq,
                    type=e.type,
                    json=compact_json(e.model_dump(mode="json")),
                    terminal=e.type == "state" and (e.data or {}).get("state") in TERMINAL,
                )
                for e in outs
            )
            return EventPage(items, ended=cursor.state in TERMINAL, full=len(rows) == EVENTS_PER_READ)


class Streams:
    """Everything the stream routes share in one API process."""

    def __init__(self, db: Database, settings: Settings, source: Source | None = None) -> None:
        self.db, self.settings = db, settings
        self.hub = WakeupHub()
        self.reader = StreamReader(db, settings, self.hub)
        self.wakeups = WakeupService(self.hub, source or self._default_source())

    def _default_source(self) -> Source:
        url = self.settings.resolved_broker_url
        if is_redis(url):
            return RedisSource(url)
        return PollSource(self._read_marks, self.settings.stream_poll_s)

    def _read_marks(self, jobs: set[int], log_jobs: set[int]) -> tuple[dict[int, int], dict[int, int]]:
        with self.db.read() as session:
            return repo.change_marks(session, jobs, log_jobs)

    async def start(self) -> None:
        await self.wakeups.start()

    async def stop(self) -> None:
        await self.wakeups.stop()


def compact_json(obj: object) -> str:
    """One line of pure ASCII: no character any SSE or line reader could take for a line end."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True)


class CallerCheck:
    """Whether the token a stream was opened with still opens it, asked again at most once per
    `stream_recheck_s`: a revoked token ends the streams it opened within that time, however
    busy they are (each stream waits at most that long between looks)."""

    def __init__(self, streams: Streams, token: str, user_for_token: Callable[[Session, str], Any]) -> None:
        self.streams, self.token, self.lookup = streams, token, user_for_token
        self.checked = time.monotonic()

    async def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.checked < self.streams.settings.stream_recheck_s:
            return True
        self.checked = now
        return await self.streams.reader.run(self._still_valid)

    def wait_s(self) -> float:
        """How long a stream may wait before it must ask again."""
        left = self.streams.settings.stream_recheck_s - (time.monotonic() - self.checked)
        return max(0.05, left)

    def _still_valid(self) -> bool:
        with self.streams.db.read() as session:
            return self.lookup(session, self.token) is not None


class Anyone:
    """No re-check: for streams whose caller is checked elsewhere (tests, internal readers)."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    async def __call__(self) -> bool:
        return True

    def wait_s(self) -> float:
        return self.streams.settings.stream_recheck_s


Allowed = CallerCheck | Anyone


# --- positions ------------------------------------------------------------------------------


def start_position(
    after: int, last_event_id: str | None, field: str = "Last-Event-ID", cap: int = MAX_POSITION
) -> int:
    """Where a stream resumes: the larger of `?after=` and the `Last-Event-ID` header."""
    if last_event_id is None or last_event_id.strip() == "":
        return after
    value = last_event_id.strip()
    if not re.fullmatch(r"[0-9]{1,18}", value):
        raise InvalidSpec((field,), "must be a non-negative integer")
    return max(after, min(int(value), cap))


def check_log_position(job: Job, node: int, attempt: int | None) -> int:
    """The attempt to read (the latest unless given); 422 for a node or attempt the job never had."""
    most = max(job.nodes, job.nodes_max or 0)  # an elastic job's earlier attempt may have had more
    if node >= most:
        raise InvalidSpec(("node",), f"job {job.id} has {most} node(s): 0..{most - 1}")
    if attempt is not None and attempt > job.attempt:
        raise InvalidSpec(("attempt",), f"job {job.id} has had {job.attempt} attempt(s)")
    return attempt if attempt is not None else job.attempt


# --- events ---------------------------------------------------------------------------------


async def event_stream(
    streams: Streams, job_id: int, after: int, allowed: Allowed | None = None
) -> AsyncIterator[EventItem]:
    """Every event with `seq > after`, once each, in order; ends after the terminal state event,
    or at once (after what is left) when the job had already ended, or when `allowed` says no."""
    allowed = allowed or Anyone(streams)
    with streams.hub.watch(job_id) as watch:
        last = after
        while await allowed():
            armed = watch.arm()
            page = await streams.reader.events(job_id, last, armed)
            for item in page.events:
                yield item
                last = item.seq
                if item.terminal:
                    return
            if page.full:
                continue
            if page.ended:
                return
            await watch.wait(allowed.wait_s())


# --- logs -----------------------------------------------------------------------------------


def read_logs(
    session: Session, settings: Settings, job: Job, *, node: int, rank: int, offset: int, attempt: int | None
) -> LogPage:
    attempt_no = check_log_position(job, node, attempt)
    data, nxt = repo.read_log(
        session,
        job_id=job.id,
        attempt=attempt_no,
        node_rank=node,
        local_rank=rank,
        offset=offset,
        limit=settings.logs_page_bytes,
    )
    return LogPage(data=data, next_offset=nxt, attempt=attempt_no)


async def log_stream(
    streams: Streams,
    job_id: int,
    *,
    attempt: int,
    node: int,
    rank: int,
    offset: int,
    allowed: Allowed | None = None,
) -> AsyncIterator[LogPiece | LogEnd]:
    """One rank's output from byte `offset`, as it is stored; ends with a `LogEnd` once the
    attempt is over on that node and everything it stored was sent (or, without one, when
    `allowed` says no)."""
    settle = timedelta(seconds=streams.settings.cancel_grace_s + LOST_NODE_SETTLE_EXTRA_S)
    allowed = allowed or Anyone(streams)
    with streams.hub.watch(job_id, logs=True) as watch:
        pos = offset
        while await allowed():
            watch.arm()
            snap = await streams.reader.run(
                _log_snapshot, streams.db, settle, job_id, attempt, node, rank, pos
            )
            data, more = snap.data, len(snap.data) >= LOG_MESSAGE_BYTES
            if data:
                last_piece = snap.complete and not more
                cut = len(data) if last_piece else utf8_cut(data)
                if cut:
                    yield LogPiece(pos, pos + cut, data[:cut].decode("utf-8", errors="replace"))
                    pos += cut
            if more:
                continue
            if snap.complete:
                yield LogEnd(pos, attempt, snap.state)
                return
            await watch.wait(allowed.wait_s())


def _log_snapshot(
    db: Database, settle: timedelta, job_id: int, attempt: int, node: int, rank: int, offset: int
) -> _LogSnapshot:
    with db.read() as session:
        # Whether the rank is done is read before its bytes: when it is, they are all stored.
        cursor = repo.job_cursor(session, job_id)
        complete, state = True, None
        if cursor is not None:
            state = cursor.state
            complete = _logs_complete(session, cursor, job_id, attempt, node, settle)
        data, nxt = repo.read_log(
            session,
            job_id=job_id,
            attempt=attempt,
            node_rank=node,
            local_rank=rank,
            offset=offset,
            limit=LOG_MESSAGE_BYTES,
        )
        return _LogSnapshot(complete=complete, state=state, data=data, next_offset=nxt)


def _logs_complete(
    session: Session, cursor: repo.JobCursor, job_id: int, attempt: int, node: int, settle: timedelta
) -> bool:
    if cursor.state not in TERMINAL and cursor.attempt == attempt:
        return False
    run = repo.node_run_end(session, job_id, attempt, node)
    if run is None or run.state in NODE_OWN_ENDS or run.state in NODE_ACTIVE:
        # Never placed; or the node reported its own end, which it does after storing its
        # last output; (active while the attempt is over cannot last: do not hang on it).
        return True
    return run.finished_at is None or utcnow() - run.finished_at > settle


def utf8_cut(data: bytes) -> int:
    """How much of `data` to send now: all of it, less a multi-byte character cut in half at
    the end (its other bytes are not stored yet)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte < 0x80 or byte > 0xF4:  # ASCII, or a byte no character starts with
            return n
        if byte >= 0xC0:
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return n if back >= need else n - back
    return n
