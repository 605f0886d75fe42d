"""Freed GPUs wake the scheduler through real Redis: the commit that frees them says so, and the
listener the API runs beside its scheduler turns that into an immediate pass."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from service.config import Settings
from service.jobs.states import free_gpus
from service.models.base import Base
from service.wakeups.message import encode, freed_in
from service.wakeups.publish import FREED_SIGNAL_MAX_BYTES, freed_signal_path, install_publisher, signal_freed
from service.wakeups.scheduler import FreedGpuFileWatcher, FreedGpuListener


class Wakes:
    """Counts the scheduler's wake-ups, as `SchedulerThread.wake` would receive them."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = threading.Condition()

    def __call__(self) -> None:
        with self.changed:
            self.count += 1
            self.changed.notify_all()

    def wait_beyond(self, count: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.count > count, timeout)


def _sqlite_factory(tmp_path: Path) -> sessionmaker:  # type: ignore[type-arg]
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    Base.metadata.create_all(engine)
    return sessionmaker(engine)


def test_the_message_says_whether_gpus_were_freed() -> None:
    assert freed_in(encode({1}, set(), freed=True))
    assert not freed_in(encode({1}, {2}))
    assert not freed_in(b"not json") and not freed_in(b"[1]")


def test_a_commit_that_frees_gpus_wakes_the_scheduler_others_do_not(tmp_path: Path, redis_url: str) -> None:
    factory = _sqlite_factory(tmp_path)
    publisher = install_publisher(factory, Settings(home=tmp_path, broker_url=redis_url))
    assert publisher is not None
    wakes = Wakes()
    listener = FreedGpuListener(redis_url, wakes)
    listener.start()
    try:
        assert listener.subscribed.wait(10)
        assert wakes.wait_beyond(0, 5)  # one pass on subscribing, for whatever came before
        baseline = wakes.count

        with factory() as session, session.begin():
            session.execute(text("select 1"))  # a commit that frees nothing
        time.sleep(0.5)
        assert wakes.count == baseline

        with factory() as session, session.begin():
            free_gpus(session, job_id=42)  # what every terminal or requeue transition does
        assert wakes.wait_beyond(baseline, 5)
    finally:
        listener.stop()
        listener.join(timeout=5)
        publisher.close()
    assert not listener.is_alive()


def test_without_redis_the_signal_file_wakes_the_scheduler(tmp_path: Path) -> None:
    """The embedded setup: worker and API share TORCHJOBS_HOME, not a broker server."""
    settings = Settings(home=tmp_path, broker_url=None)
    factory = _sqlite_factory(tmp_path)
    assert install_publisher(factory, settings) is None
    wakes = Wakes()
    watcher = FreedGpuFileWatcher(freed_signal_path(settings), wakes, poll_s=0.01)
    watcher.start()
    try:
        with factory() as session, session.begin():
            session.execute(text("select 1"))
        time.sleep(0.3)
        assert wakes.count == 0 and not freed_signal_path(settings).exists()

        for expected in range(1, 4):
            with factory() as session, session.begin():
                free_gpus(session, job_id=expected)
            assert wakes.wait_beyond(expected - 1, 5)
            time.sleep(0.05)
        assert freed_signal_path(settings).stat().st_size <= FREED_SIGNAL_MAX_BYTES
    finally:
        watcher.stop()
        watcher.join(timeout=5)
    assert not watcher.is_alive()


def test_every_signal_changes_the_file_size_and_it_stays_small(tmp_path: Path) -> None:
    path = tmp_path / "wakeups" / "gpus-freed"
    sizes = []
    for _ in range(FREED_SIGNAL_MAX_BYTES + 3):
        signal_freed(path)
        sizes.append(path.stat().st_size)
    assert all(a != b for a, b in zip(sizes, sizes[1:], strict=False))
    assert max(sizes) == FREED_SIGNAL_MAX_BYTES and 0 in sizes
