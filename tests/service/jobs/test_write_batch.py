"""A node's batch on both databases: events appended with gap-free `seq`s, the job's progress
merged, and the job's (state, attempt) returned for the supervisor's look; reports of an
attempt that is no longer the job's are not appended; a kept connection that PostgreSQL
ended is replaced at the next batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import OperationalError

from service.config import Settings
from service.db import Database, KeptConnection
from service.jobs.node_reports import Batch, NodeKey
from service.jobs.reports import write_batch
from service.migrate import upgrade
from service.models import Job, JobEvent
from service.testing.harness import PG_ADMIN_URL
from tests.factories import make_job, make_user, set_job_state


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    else:
        url = request.getfixturevalue("pg_url")
    settings = Settings(home=tmp_path, database_url=url)
    upgrade(settings)
    database = Database(settings)
    yield database
    database.dispose()


def running_job(db: Database, attempt: int = 1) -> int:
    with db.transaction() as s:
        job = make_job(
            s,
            make_user(s).id,
            "running",
            entrypoint={"kind": "builtin", "model": "mlp", "dataset": "digits"},
            attempt=attempt,
            progress={"epoch": 0, "val_loss": 2.5},
        )
        return job.id


def reports(*steps: int) -> Batch:
    return Batch(events=[{"type": "progress", "step": step, "loss": 1.0 / step} for step in steps])


def stored(db: Database, job_id: int) -> tuple[list[int], list[int], dict]:
    with db.transaction() as s:
        events = s.execute(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.type == "progress")
            .order_by(JobEvent.seq)
        ).scalars()
        seqs_steps = [(e.seq, e.data.get("step")) for e in events]
        job = s.get(Job, job_id)
        assert job is not None
        return [q for q, _ in seqs_steps], [st for _, st in seqs_steps], dict(job.progress or {})


def test_a_batch_appends_merges_progress_and_returns_the_job(db: Database) -> None:
    job_id = running_job(db)
    node = KeptConnection(db)
    key = NodeKey(job_id=job_id, attempt=1, node_rank=0)
    assert write_batch(node, key, reports(1, 2, 3)) == ("running", 1)
    assert write_batch(node, key, reports(4)) == ("running", 1)
    assert write_batch(node, key, Batch()) is None  # nothing to write: no transaction, no look
    seqs, steps, progress = stored(db, job_id)
    assert seqs == [4, 5, 6, 7] and steps == [1, 2, 3, 4]  # after the seeded states' 3 events, no gap
    assert progress == {"epoch": 0, "val_loss": 2.5, "step": 4, "loss": 0.25}  # merged, not replaced
    with db.transaction() as s:
        set_job_state(s, job_id, "cancelling")
    assert write_batch(node, key, Batch(logs=[(0, 0, b"hello\n")])) == ("cancelling", 1)
    node.close()


def test_reports_of_an_attempt_that_is_over_are_not_appended(db: Database) -> None:
    job_id = running_job(db, attempt=2)
    node = KeptConnection(db)
    assert write_batch(node, NodeKey(job_id=job_id, attempt=1, node_rank=0), reports(7)) == ("running", 2)
    assert stored(db, job_id)[0] == []
    assert write_batch(node, NodeKey(job_id=job_id + 1, attempt=1, node_rank=0), reports(1)) is None  # gone
    node.close()


def test_a_broken_kept_connection_is_replaced_at_the_next_batch(pg_url: str, tmp_path: Path) -> None:
    """PostgreSQL ends the node's backend (a restart, an idle timeout, a fail-over)."""
    settings = Settings(home=tmp_path, database_url=pg_url)
    upgrade(settings)
    db = Database(settings)
    job_id = running_job(db)
    node = KeptConnection(db)
    key = NodeKey(job_id=job_id, attempt=1, node_rank=0)
    assert write_batch(node, key, reports(1)) == ("running", 1)
    assert node.conn is not None
    backend = node.conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    node.conn.rollback()
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    with pytest.raises(OperationalError):
        write_batch(node, key, reports(2))
    assert node.conn is None  # dropped: the supervisor keeps the batch and tries again
    assert write_batch(node, key, reports(2)) == ("running", 1)
    assert stored(db, job_id)[1] == [1, 2]
    node.close()
    db.dispose()
