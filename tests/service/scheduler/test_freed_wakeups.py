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
from service.notify import encode, freed_in, install_publisher
from service.scheduler.wakeups import FreedGpuListener


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


def test_the_message_says_whether_gpus_were_freed() -> None:
    assert freed_in(encode({1}, set(), freed=True))
    assert not freed_in(encode({1}, {2}))
    assert not freed_in(b"not json") and not freed_in(b"[1]")


def test_a_commit_that_frees_gpus_wakes_the_scheduler_others_do_not(tmp_path: Path, redis_url: str) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    Base.metadata.create_all(engine)
    factory = sessionmaker(engine)
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
