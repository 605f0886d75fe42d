"""The gates against a real database: what each writer does besides the `state` column."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from service.config import Settings
from service.db import Database
from service.errors import Conflict
from service.hosts.states import heartbeat, take_offline
from service.jobs.states import transition_job, transition_node
from service.migrate import upgrade
from service.models import Job, JobEvent, Worker
from tests.factories import make_job, make_node_run, make_user, make_worker


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    settings = Settings(home=tmp_path, admin_token="x")
    upgrade(settings)
    database = Database(settings)
    yield database
    database.dispose()


def test_a_created_job_is_queued_with_its_first_event(db: Database) -> None:
    with db.transaction() as s:
        job = make_job(s, make_user(s).id)
        events = s.execute(select(JobEvent).where(JobEvent.job_id == job.id)).scalars().all()
        assert job.state == "queued" and job.queued_at is not None
        assert [(e.seq, e.type, e.data) for e in events] == [
            (1, "state", {"state": "queued", "reason": "submitted"})
        ]


def test_a_refused_move_changes_nothing(db: Database) -> None:
    with db.transaction() as s:
        job = make_job(s, make_user(s).id)
        with pytest.raises(Conflict):
            transition_job(s, job, "running")
        with pytest.raises(Conflict):
            transition_job(s, job, "bogus")
        events = s.execute(select(JobEvent.seq).where(JobEvent.job_id == job.id)).scalars().all()
        assert job.state == "queued" and events == [1]


def test_a_node_keeps_its_first_end(db: Database) -> None:
    with db.transaction() as s:
        job = make_job(s, make_user(s).id, "running")
        run = make_node_run(s, job, "running")
        assert run.started_at is not None and run.worker_session == "seeded"
        assert transition_node(run, "failed", exit_code=3, error="boom")
        assert not transition_node(run, "lost", error="worker lost")  # a late verdict
        assert (run.state, run.exit_code, run.error) == ("failed", 3, "boom")
        assert run.finished_at is not None
        pending = make_node_run(s, job, node_rank=1)
        assert not transition_node(pending, "succeeded")  # it never ran
        assert pending.state == "pending"


def test_a_host_taken_offline_comes_back_with_its_heartbeat(db: Database) -> None:
    with db.transaction() as s:
        worker = make_worker(s, "w1")
        assert take_offline(worker) and not take_offline(worker)
    with db.transaction() as s:
        assert heartbeat(s, "w1", "w1-session", worker.last_heartbeat)
        assert not heartbeat(s, "w1", "another-session", worker.last_heartbeat)
    with db.transaction() as s:
        assert s.execute(select(Worker.state).where(Worker.name == "w1")).scalar_one() == "online"
        assert s.execute(select(Job)).first() is None
