"""Receiving wake-ups, in the API process: one `WakeupHub` holds the open streams' `Watch`es
and is fed by one source: a `RedisSource` (a single subscriber for the whole process), or on
the embedded setup a `PollSource` (one shared query every `stream_poll_s` over the jobs being
watched). Streams also re-read every `stream_recheck_s` on their own, which bounds the delay
when a publish is lost (Redis down for a moment).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Protocol

import anyio

from service.wakeups.message import channel_for, decode

log = logging.getLogger("torchjobs.notify")


class Watch:
    """One open stream's interest in one job. `arm()` before reading, `wait()` after: a wake-up
    that lands between the two is kept, so none is ever missed."""

    def __init__(self, hub: WakeupHub, job_id: int, logs: bool) -> None:
        self.hub, self.job_id, self.logs = hub, job_id, logs
        self._flag = asyncio.Event()

    def arm(self) -> int:
        """Clear the flag; returns the job's wake-up version at this moment."""
        self._flag.clear()
        return self.hub.version(self.job_id)

    def wake(self) -> None:
        self._flag.set()

    async def wait(self, timeout: float) -> bool:
        """True when woken, False when the timeout passed first."""
        try:
            async with asyncio.timeout(timeout):
                await self._flag.wait()
        except TimeoutError:
            return False
        return True


class WakeupHub:
    """Per API process: who waits on which job. Runs on the event loop; not thread-safe.

    Each watched job has a version that rises with every wake-up of its event streams (from one
    counter for the whole hub, so a job watched again never reuses an old version). A read begun
    at version v has seen every commit whose wake-up came before it; a stream armed at version
    a may therefore share that read when v >= a: nothing woke the job in between.
    """

    def __init__(self) -> None:
        self._watches: dict[int, set[Watch]] = {}
        self._versions: dict[int, int] = {}
        self._clock = itertools.count(1)

    @contextlib.contextmanager
    def watch(self, job_id: int, *, logs: bool = False) -> Iterator[Watch]:
        w = Watch(self, job_id, logs)
        if job_id not in self._watches:
            self._watches[job_id] = set()
            self._versions[job_id] = next(self._clock)
        self._watches[job_id].add(w)
        try:
            yield w
        finally:
            group = self._watches.get(job_id)
            if group is not None:
                group.discard(w)
                if not group:
                    del self._watches[job_id]
                    del self._versions[job_id]

    def version(self, job_id: int) -> int:
        """The job's current version (a fresh one, never shared, for a job nobody watches)."""
        version = self._versions.get(job_id)
        return version if version is not None else next(self._clock)

    def wake(self, job_id: int, *, logs_only: bool = False) -> None:
        """New events wake every watch of the job (log streams end on the job's state change);
        new log chunks wake only the log watches."""
        group = self._watches.get(job_id)
        if not group:
            return
        if not logs_only:
            self._versions[job_id] = next(self._clock)
        for w in tuple(group):
            if w.logs or not logs_only:
                w.wake()

    def wake_all(self) -> None:
        for job_id in tuple(self._watches):
            self.wake(job_id)

    def apply(self, raw: bytes | str) -> None:
        events, logs = decode(raw)
        for job_id in events:
            self.wake(job_id)
        for job_id in logs:
            self.wake(job_id, logs_only=True)

    def watched(self) -> tuple[set[int], set[int]]:
        """(jobs with any watch, jobs with a log watch)."""
        log_jobs = {j for j, group in self._watches.items() if any(w.logs for w in group)}
        return set(self._watches), log_jobs

    @property
    def open_watches(self) -> int:
        return sum(len(g) for g in self._watches.values())


class Source(Protocol):
    async def run(self, hub: WakeupHub) -> None: ...


class RedisSource:
    """The process's single subscriber. After every (re)subscription it wakes everyone:
    whatever was published while it was not listening is then read from the database."""

    def __init__(self, url: str) -> None:
        self.url, self.channel = url, channel_for(url)

    async def run(self, hub: WakeupHub) -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        backoff = 0.5
        while True:
            client = aioredis.Redis.from_url(self.url, health_check_interval=15, socket_connect_timeout=3)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                hub.wake_all()
                backoff = 0.5
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
                    if msg is not None and msg.get("type") == "message":
                        hub.apply(msg["data"])
            except (RedisError, OSError) as exc:
                log.warning("stream wake-up subscriber lost Redis (%s); retrying in %.1fs", exc, backoff)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


MarksReader = Callable[[set[int], set[int]], tuple[dict[int, int], dict[int, int]]]


class PollSource:
    """The embedded setup's fallback: one query per interval for the whole process, however
    many streams are open. `read_marks(jobs, log_jobs)` returns, per job, a number that grows
    when it gets events (its `last_event_seq`) and when it gets log chunks (the newest id)."""

    def __init__(self, read_marks: MarksReader, interval_s: float) -> None:
        self.read_marks, self.interval_s = read_marks, interval_s

    async def run(self, hub: WakeupHub) -> None:
        seen_events: dict[int, int] = {}
        seen_logs: dict[int, int] = {}
        while True:
            await asyncio.sleep(self.interval_s)
            jobs, log_jobs = hub.watched()
            if not jobs:
                seen_events, seen_logs = {}, {}
                continue
            try:
                events, logs = await anyio.to_thread.run_sync(self.read_marks, jobs, log_jobs)
            except Exception:
                log.exception("stream poll failed; retrying")
                continue
            for job_id in jobs:
                # A job seen for the first time wakes too: its streams may have read just before
                # the change this first look already counts as seen.
                if job_id not in seen_events or events.get(job_id) != seen_events[job_id]:
                    hub.wake(job_id)
            for job_id in log_jobs:
                if job_id not in seen_logs or logs.get(job_id) != seen_logs[job_id]:
                    hub.wake(job_id, logs_only=True)
            seen_events = {j: events.get(j, 0) for j in jobs}
            seen_logs = {j: logs.get(j, 0) for j in log_jobs}


class WakeupService:
    """The hub plus its running source, started and stopped with the app."""

    def __init__(self, hub: WakeupHub, source: Source) -> None:
        self.hub, self.source = hub, source
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.source.run(self.hub), name="torchjobs-wakeups")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
