"""Publishing wake-ups, in every process (API, scheduler, workers).

`install_publisher()` hooks the sessionmaker's `after_commit`. The ids that the committed
transaction appended events to or wrote log chunks for (marked with `message.mark_events` and
`message.mark_logs`) go out as one Redis PUBLISH, when the broker is Redis. A transaction that
gave GPUs back (`mark_freed`) says so in the same message, which `scheduler.FreedGpuListener`
hears. Without Redis nothing is published for streams, and a commit that freed GPUs appends a
byte to `freed_signal_path()`, which `scheduler.FreedGpuFileWatcher` watches.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.wakeups.message import NOTIFY_EVENTS, NOTIFY_FREED, NOTIFY_LOGS, channel_for, encode, is_redis

log = logging.getLogger("torchjobs.notify")

QUIET_AFTER_FAILURE_S = 5.0
FREED_SIGNAL_MAX_BYTES = 4096


class RedisPublisher:
    """A synchronous PUBLISH after each commit; a failure is logged and never fails the commit
    (it has already happened). After a failure it stays quiet for a few seconds so that a
    Redis outage does not add a connect timeout to every transaction."""

    def __init__(self, url: str) -> None:
        import redis

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.channel = channel_for(url)
        self._quiet_until = 0.0

    def publish(self, events: set[int], logs: set[int], freed: bool = False) -> None:
        now = time.monotonic()
        if now < self._quiet_until:
            return
        try:
            self.client.publish(self.channel, encode(events, logs, freed))
        except self._errors as exc:
            self._quiet_until = now + QUIET_AFTER_FAILURE_S
            log.warning("stream wake-up not published (%s); streams re-read on their own timer", exc)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


def freed_signal_path(settings: Settings) -> Path:
    """Without Redis (the embedded setup: one machine, one TORCHJOBS_HOME) a commit that freed
    GPUs appends a byte to this file, and the scheduler watches its size and time."""
    return settings.home / "wakeups" / "gpus-freed"


def signal_freed(path: Path) -> None:
    """Append one byte (truncating now and then): every signal changes the file's size, even
    two within one tick of the file system's clock."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as f:
            if f.tell() >= FREED_SIGNAL_MAX_BYTES:
                f.truncate(0)
            else:
                f.write(b".")


def install_publisher(factory: sessionmaker[Session], settings: Settings) -> RedisPublisher | None:
    if not is_redis(settings.resolved_broker_url):
        _install_freed_file(factory, freed_signal_path(settings))
        _install_cleanup(factory)
        return None
    publisher = RedisPublisher(settings.resolved_broker_url)

    @event.listens_for(factory, "after_commit")
    def _after_commit(session: Session) -> None:
        if session.in_nested_transaction():
            return  # a SAVEPOINT released: nothing is visible to others until the outer commit
        events = session.info.pop(NOTIFY_EVENTS, None) or set()
        logs = session.info.pop(NOTIFY_LOGS, None) or set()
        freed = bool(session.info.pop(NOTIFY_FREED, False))
        if events or logs or freed:
            publisher.publish(events, logs, freed)

    _install_cleanup(factory)
    return publisher


def _install_freed_file(factory: sessionmaker[Session], path: Path) -> None:
    @event.listens_for(factory, "after_commit")
    def _after_commit(session: Session) -> None:
        if session.in_nested_transaction():
            return
        if session.info.pop(NOTIFY_FREED, False):
            signal_freed(path)


def _install_cleanup(factory: sessionmaker[Session]) -> None:
    """What a rolled-back transaction marked must not leak into the session's next one."""

    @event.listens_for(factory, "after_transaction_end")
    def _after_end(session: Session, transaction: Any) -> None:
        if transaction.parent is None:
            session.info.pop(NOTIFY_EVENTS, None)
            session.info.pop(NOTIFY_LOGS, None)
            session.info.pop(NOTIFY_FREED, None)
