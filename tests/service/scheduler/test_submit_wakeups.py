"""A submit buys a scheduler pass of its own only while the last pass left a GPU free
(`SchedulerThread.wake_for_submit`); against a full cluster the timed pass places and
explains the new job."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from service.scheduler.placement_pass import Room, run_pass
from service.scheduler.thread import SchedulerThread
from tests.factories import make_job, make_user, make_worker


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    settings = Settings(home=tmp_path, admin_token="x", heartbeat_timeout_s=3600)
    upgrade(settings)
    database = Database(settings)
    yield database
    database.dispose()


def _queue(db: Database, n: int = 1) -> None:
    """`n` one-GPU jobs of one user (each test queues once)."""
    with db.transaction() as session:
        user = make_user(session)
        for _ in range(n):
            make_job(session, user.id)


def _pass(db: Database) -> Room:
    room = Room()
    run_pass(db, db.settings, lambda _sent: None, room=room)
    return room


def test_no_worker_leaves_no_gpu_free(db: Database) -> None:
    _queue(db)
    assert _pass(db).gpu_free is False


def test_a_gpu_left_after_placement_is_free(db: Database) -> None:
    with db.transaction() as session:
        make_worker(session, "w1", gpus=2)
    _queue(db)
    assert _pass(db).gpu_free is True  # one job on one of two slots


def test_a_cluster_filled_by_the_pass_is_full(db: Database) -> None:
    with db.transaction() as session:
        make_worker(session, "w1", gpus=2)
    _queue(db, n=3)  # two placed, one left waiting
    assert _pass(db).gpu_free is False


def test_an_empty_queue_says_nothing_of_the_hosts(db: Database) -> None:
    assert _pass(db).gpu_free is True


def test_a_submit_wakes_the_scheduler_only_while_a_gpu_is_free(db: Database) -> None:
    scheduler = SchedulerThread(db, db.settings, lambda _sent: None)  # not started: its event only
    scheduler.room.gpu_free = False
    scheduler.wake_for_submit()
    assert not scheduler._wake.is_set()
    scheduler.wake()  # a freed GPU, a new host: always
    assert scheduler._wake.is_set()
    scheduler._wake.clear()
    scheduler.room.gpu_free = True
    scheduler.wake_for_submit()
    assert scheduler._wake.is_set()
