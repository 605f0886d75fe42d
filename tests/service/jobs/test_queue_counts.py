"""The queue's counts per priority (`queue_counts`, #42) against the queue itself, on both
databases: every way a job enters or leaves the queue keeps them equal, and the position a
submit answers from them is the one counted over the queue (what `GET /v1/jobs/{id}` shows).
On PostgreSQL, concurrent submits at one priority get exact positions, and writers that move
jobs of two priorities in opposite orders do not deadlock on the counts."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import false, func, select, true

from service.auth.tokens import ensure_admin
from service.config import Settings
from service.db import Database
from service.jobs import repository as repo
from service.jobs.service import new_job
from service.jobs.spec import JobSpec
from service.jobs.states import WriteGuard, create_job_if, lock_job, transition_job
from service.migrate import upgrade
from service.models import Job, User
from tests.factories import make_job, make_worker, set_job_state
from tests.service.jobs.on_sqlite import api_client, schedule

TOKEN = "tj_queue_counts_admin_token_0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "digits"}
SPEC = JobSpec.model_validate({"mode": "single", "entrypoint": ENTRY})
ALWAYS = WriteGuard(true())


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    extra: dict[str, Any] = {"database_url": url} if url else {}
    s = Settings(
        home=tmp_path, admin_token=TOKEN, heartbeat_timeout_s=3600, broker_url="filesystem://", **extra
    )
    upgrade(s)
    with Database(s).transaction() as session:
        ensure_admin(session, s)
        make_worker(session, "w1", gpus=1)
    return s


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with api_client(settings) as client:
        yield client


def counts_match_the_queue(settings: Settings) -> dict[int, int]:
    db = Database(settings)
    with db.read() as session:
        counted = repo.queue_counts(session)
        rows = session.execute(
            select(Job.priority, func.count()).where(Job.state == "queued").group_by(Job.priority)
        ).all()
    db.dispose()
    assert counted == {int(p): int(n) for p, n in rows}
    return counted


def submit(api: TestClient, headers: dict[str, str] = ADMIN, **fields: Any) -> dict[str, Any]:
    answer = api.post("/v1/jobs", json={"mode": "single", "entrypoint": ENTRY, **fields}, headers=headers)
    assert answer.status_code in (200, 201), answer.text
    body: dict[str, Any] = answer.json()
    return body


def position_is_the_queues(api: TestClient, body: dict[str, Any]) -> None:
    """The submit's answer is what the count over the queue gives (a queued job's view is never cached)."""
    shown = api.get(f"/v1/jobs/{body['id']}", headers=ADMIN).json()
    assert body["queue_position"] == shown["queue_position"], (body, shown)


def test_every_way_in_and_out_of_the_queue_keeps_the_counts(api: TestClient, settings: Settings) -> None:
    jobs = [submit(api, priority=p) for p in (0, 5, 0, 5, -3, 0)]
    for body in jobs:
        assert body["state"] == "queued"
    assert [j["queue_position"] for j in jobs] == [1, 1, 3, 2, 5, 5]
    assert counts_match_the_queue(settings) == {0: 3, 5: 2, -3: 1}

    cancelled = api.post(f"/v1/jobs/{jobs[2]['id']}/cancel", headers=ADMIN)
    assert cancelled.json()["state"] == "cancelled"
    assert counts_match_the_queue(settings) == {0: 2, 5: 2, -3: 1}

    schedule(settings)  # one GPU: the first job of priority 5 is placed
    assert api.get(f"/v1/jobs/{jobs[1]['id']}", headers=ADMIN).json()["state"] == "scheduled"
    assert counts_match_the_queue(settings) == {0: 2, 5: 1, -3: 1}

    db = Database(settings)
    with db.transaction() as session:  # back into the queue, as a lost node's retry puts it
        set_job_state(session, jobs[1]["id"], "queued")
    db.dispose()
    assert counts_match_the_queue(settings) == {0: 2, 5: 2, -3: 1}
    position_is_the_queues(api, later := submit(api, priority=5))
    assert later["queue_position"] == 3

    keyed = {**ADMIN, "Idempotency-Key": "once"}
    first, again = submit(api, keyed, priority=0), submit(api, keyed, priority=0)
    assert first["id"] == again["id"]
    position_is_the_queues(api, first)
    assert counts_match_the_queue(settings) == {0: 3, 5: 3, -3: 1}

    grid = {"hyperparameters.lr": [0.1, 0.01, 0.001]}
    parent = submit(api, sweep={"grid": grid})  # the parent runs at once, its children queue
    assert parent["state"] == "running"
    assert counts_match_the_queue(settings) == {0: 6, 5: 3, -3: 1}

    doomed = submit(api, depends_on=[{"job_id": jobs[2]["id"]}])  # on a cancelled job: fails at once
    assert doomed["state"] == "failed" and doomed["queue_position"] is None
    assert counts_match_the_queue(settings) == {0: 6, 5: 3, -3: 1}
    position_is_the_queues(api, submit(api, priority=-3))


def test_a_rolled_back_transaction_or_savepoint_counts_nothing(settings: Settings) -> None:
    db = Database(settings)
    with pytest.raises(RuntimeError, match="rolled back"):
        seed_then_fail(db)
    assert counts_match_the_queue(settings) == {}
    with db.transaction() as session:
        admin = session.execute(select(User).where(User.name == "admin")).scalar_one()
        kept = make_job(session, admin.id, priority=1)
        savepoint = session.begin_nested()
        make_job(session, admin.id, priority=1)
        transition_job(session, kept, "cancelling")
        savepoint.rollback()
        with session.begin_nested():  # released: its moves are the transaction's
            make_job(session, admin.id, priority=2)
            with session.begin_nested():
                make_job(session, admin.id, priority=2)
    db.dispose()
    assert counts_match_the_queue(settings) == {1: 1, 2: 2}


def seed_then_fail(db: Database) -> None:
    with db.transaction() as session:
        admin = session.execute(select(User).where(User.name == "admin")).scalar_one()
        make_job(session, admin.id, priority=1)
        raise RuntimeError("rolled back")


def test_a_guard_that_fails_writes_nothing(settings: Settings) -> None:
    db = Database(settings)
    with db.transaction() as session:
        admin = session.execute(select(User).where(User.name == "admin")).scalar_one()
        job = new_job(
            session, admin, JobSpec.model_validate({"mode": "single", "entrypoint": ENTRY}), None, None
        )
        assert create_job_if(session, job, WriteGuard(false()), {}) is None
        assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    db.dispose()
    assert counts_match_the_queue(settings) == {}


# -- PostgreSQL: writers at once ---------------------------------------------------------------


@pytest.fixture
def pg_settings(pg_url: str, tmp_path: Path) -> Settings:
    s = Settings(home=tmp_path, database_url=pg_url, admin_token=TOKEN)
    upgrade(s)
    with Database(s).transaction() as session:
        ensure_admin(session, s)
    return s


def in_threads(n: int, work: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    return results


def test_concurrent_submits_at_one_priority_get_exact_positions(pg_settings: Settings) -> None:
    """Each holds its transaction open a while after its write: a new job never counts one
    created after it (its id is drawn after the count's row lock), nor misses one before it."""
    db = Database(pg_settings)
    with db.transaction() as session:
        owner_id = session.execute(select(User.id).where(User.name == "admin")).scalar_one()

    def submit_one(_: int) -> tuple[int, int]:
        with db.transaction() as session:
            owner = session.get(User, owner_id)
            assert owner is not None
            job = new_job(session, owner, SPEC, None, None)
            position = create_job_if(session, job, ALWAYS, {})
            assert position is not None
            time.sleep(random.uniform(0, 0.05))
            return job.id, position

    made = in_threads(12, submit_one)
    db.dispose()
    by_id = sorted(made)
    assert [position for _, position in by_id] == list(range(1, 13))
    assert counts_match_the_queue(pg_settings) == {0: 12}


def test_moves_of_two_priorities_in_opposite_orders_do_not_deadlock(pg_settings: Settings) -> None:
    """A scheduling pass and a cancel cascade may move jobs of several priorities in any order;
    the counts are added at commit in one order, so neither waits for the other crosswise."""
    db = Database(pg_settings)
    with db.transaction() as session:
        owner_id = session.execute(select(User.id).where(User.name == "admin")).scalar_one()
        pairs = [
            (make_job(session, owner_id, priority=0).id, make_job(session, owner_id, priority=5).id)
            for _ in range(2)
        ]
    barrier = threading.Barrier(2)

    def move(i: int) -> None:
        first, second = pairs[i] if i == 0 else pairs[i][::-1]
        with db.transaction() as session:
            for job_id in (first, second):
                job = lock_job(session, job_id)
                assert job is not None
                transition_job(session, job, "cancelling")
                session.flush()
                if job_id == first:
                    barrier.wait(timeout=10)

    in_threads(2, move)
    db.dispose()
    assert counts_match_the_queue(pg_settings) == {}
