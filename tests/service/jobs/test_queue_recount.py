"""The queue's counts set back to the queue itself (`recount_queue`, #42): a write that went
round the gate (a hand-edited row, a restored backup) leaves positions wrong until the next
recount, which corrects them and says by how much; on PostgreSQL a recount while moves and
submits are in flight neither misses nor doubles them; the scheduler's thread runs it every
`queue_recount_s`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text, true

from service.auth.tokens import ensure_admin
from service.config import Settings
from service.db import Database
from service.jobs import repository as repo
from service.jobs.queue_counts import recount_queue
from service.jobs.service import new_job
from service.jobs.spec import JobSpec
from service.jobs.states import WriteGuard, create_job_if, lock_job, transition_job
from service.migrate import upgrade
from service.models import User
from service.scheduler.thread import SchedulerThread
from tests.factories import make_job

TOKEN = "tj_queue_recount_admin_token_0123456789"
ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "digits"}
SPEC = JobSpec.model_validate({"mode": "single", "entrypoint": ENTRY})


def _database(settings: Settings) -> Database:
    upgrade(settings)
    database = Database(settings)
    with database.transaction() as session:
        ensure_admin(session, settings)
    return database


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    extra: dict[str, Any] = {"database_url": url} if url else {}
    database = _database(Settings(home=tmp_path, admin_token=TOKEN, broker_url="filesystem://", **extra))
    yield database
    database.dispose()


@pytest.fixture
def pg_db(pg_url: str, tmp_path: Path) -> Iterator[Database]:
    """PostgreSQL only: on SQLite one writer runs at a time, so nothing is in flight beside a
    recount (the tests above run there too)."""
    database = _database(Settings(home=tmp_path, admin_token=TOKEN, database_url=pg_url))
    yield database
    database.dispose()


def admin_id(db: Database) -> int:
    with db.read() as session:
        return int(session.execute(select(User.id).where(User.name == "admin")).scalar_one())


def queued_jobs(db: Database, priorities: list[int]) -> list[int]:
    owner = admin_id(db)
    with db.transaction() as session:
        return [make_job(session, owner, priority=p).id for p in priorities]


def counted(db: Database) -> dict[int, int]:
    with db.read() as session:
        return repo.queue_counts(session)


def recount(db: Database) -> dict[int, int]:
    with db.transaction() as session:
        return recount_queue(session)


def test_writes_round_the_gate_are_corrected_and_reported(db: Database) -> None:
    jobs = queued_jobs(db, [0, 0, 5, 5, 5])
    assert recount(db) == {}  # the gate kept them: nothing to correct
    with db.transaction() as session:  # an operator's hand edits, none through the gate
        session.execute(text("UPDATE jobs SET state = 'cancelled' WHERE id = :id"), {"id": jobs[0]})
        session.execute(text("UPDATE queue_counts SET jobs = jobs + 7 WHERE priority = 5"))
        session.execute(text("UPDATE jobs SET priority = 9 WHERE id = :id"), {"id": jobs[4]})
    assert counted(db) == {0: 2, 5: 10}
    assert recount(db) == {0: -1, 5: -8, 9: 1}
    assert counted(db) == {0: 1, 5: 2, 9: 1}
    assert recount(db) == {}
    with db.transaction() as session:  # every count row gone (a restore that left them out)
        session.execute(text("DELETE FROM queue_counts"))
    assert recount(db) == {0: 1, 5: 2, 9: 1}
    assert counted(db) == {0: 1, 5: 2, 9: 1}


def test_a_move_in_flight_is_neither_missed_nor_counted_twice(pg_db: Database) -> None:
    db = pg_db
    job_id, _other = queued_jobs(db, [3, 3])
    moved, done = threading.Event(), threading.Event()

    def cancel_slowly() -> None:
        with db.transaction() as session:
            job = lock_job(session, job_id)
            assert job is not None
            transition_job(session, job, "cancelling")
            session.flush()  # the job's new state written, not committed, its count not yet added
            moved.set()
            time.sleep(0.5)  # the recount runs now
        done.set()

    mover = threading.Thread(target=cancel_slowly)
    mover.start()
    assert moved.wait(10)
    assert recount(db) == {}  # the job still queued as far as any commit says
    mover.join(10)
    assert done.is_set()
    assert counted(db) == {3: 1}
    assert recount(db) == {}


def test_a_submit_in_flight_is_waited_for_and_counted_once(pg_db: Database) -> None:
    db = pg_db
    queued_jobs(db, [0])
    owner = admin_id(db)
    results: list[dict[int, int]] = []
    with db.transaction() as session:  # the count's row lock is taken by the submit itself
        user = session.get(User, owner)
        assert user is not None
        assert create_job_if(session, new_job(session, user, SPEC, None, None), WriteGuard(true()), {}) == 2
        recounter = threading.Thread(target=lambda: results.append(recount(db)))
        recounter.start()
        recounter.join(0.5)
        assert recounter.is_alive()  # waits on the submit's count row, as a writer would
    recounter.join(10)
    assert results == [{}]
    assert counted(db) == {0: 2}


def test_the_scheduler_recounts_every_queue_recount_s(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    queued_jobs(db, [1])
    with db.transaction() as session:
        session.execute(text("UPDATE queue_counts SET jobs = jobs + 4"))
    settings = db.settings.model_copy(update={"queue_recount_s": 0.2})
    thread = SchedulerThread(db, settings, lambda _dispatches: None)
    thread._recount_when_due()  # not due yet: the counts are left as they are
    assert counted(db) == {1: 5}
    time.sleep(0.25)
    with caplog.at_level(logging.WARNING, "torchjobs.scheduler"):
        thread._recount_when_due()
    assert counted(db) == {1: 1}
    assert "drifted" in caplog.text and "{1: -4}" in caplog.text
    never = SchedulerThread(db, db.settings.model_copy(update={"queue_recount_s": 0}), lambda _d: None)
    with db.transaction() as session:
        session.execute(text("UPDATE queue_counts SET jobs = jobs + 4 WHERE source = 'new'"))
    time.sleep(0.05)
    never._recount_when_due()
    assert counted(db) == {1: 5}
