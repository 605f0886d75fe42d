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
from service.jobs.lifecycle import finish_node
from service.jobs.reports import job_control, peers_ended_at, write_batch
from service.migrate import upgrade
from service.models import Job, JobEvent
from service.nodes.values import Batch, JobControl, NodeKey, NodeOutcome
from service.states import NodeState
from service.testing.harness import PG_ADMIN_URL
from tests.factories import make_job, make_node_run, make_user, set_job_state


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


def state_of(control: JobControl | None) -> tuple[str, int] | None:
    return None if control is None else (str(control.state), control.attempt)


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
    assert state_of(write_batch(node, key, reports(1, 2, 3))) == ("running", 1)
    assert state_of(write_batch(node, key, reports(4))) == ("running", 1)
    assert write_batch(node, key, Batch()) is None  # nothing to write: no transaction, no look
    seqs, steps, progress = stored(db, job_id)
    assert seqs == [4, 5, 6, 7] and steps == [1, 2, 3, 4]  # after the seeded states' 3 events, no gap
    assert progress == {"epoch": 0, "val_loss": 2.5, "step": 4, "loss": 0.25}  # merged, not replaced
    with db.transaction() as s:
        set_job_state(s, job_id, "cancelling")
    assert state_of(write_batch(node, key, Batch(logs=[(0, 0, b"hello\n")]))) == ("cancelling", 1)
    node.close()


def test_reports_of_an_attempt_that_is_over_are_not_appended(db: Database) -> None:
    job_id = running_job(db, attempt=2)
    node = KeptConnection(db)
    assert state_of(write_batch(node, NodeKey(job_id=job_id, attempt=1, node_rank=0), reports(7))) == (
        "running",
        2,
    )
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
    assert state_of(write_batch(node, key, reports(1))) == ("running", 1)
    assert node.conn is not None
    backend = node.conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    node.conn.rollback()
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    with pytest.raises(OperationalError):
        write_batch(node, key, reports(2))
    assert node.conn is None  # dropped: the supervisor keeps the batch and tries again
    assert state_of(write_batch(node, key, reports(2))) == ("running", 1)
    assert stored(db, job_id)[1] == [1, 2]
    node.close()
    db.dispose()


def test_every_report_moves_the_stall_clock_of_its_own_attempt_only(db: Database) -> None:
    """Contract §8: a log byte, an event or a checkpoint of the current attempt is a report;
    an earlier attempt's late output is not."""
    job_id = running_job(db, attempt=2)
    node = KeptConnection(db)
    old = write_batch(node, NodeKey(job_id=job_id, attempt=1, node_rank=0), Batch(logs=[(0, 0, b"x\n")]))
    assert old is not None and old.last_report_at is None
    logs = write_batch(node, NodeKey(job_id=job_id, attempt=2, node_rank=1), Batch(logs=[(0, 0, b"x\n")]))
    assert logs is not None and logs.last_report_at is not None
    later = write_batch(node, NodeKey(job_id=job_id, attempt=2, node_rank=0), reports(1))
    assert (
        later is not None and later.last_report_at is not None and later.last_report_at >= logs.last_report_at
    )
    seen = job_control(db, job_id)
    assert seen is not None and seen.last_report_at == later.last_report_at
    node.close()


def test_a_node_learns_when_all_its_peers_have_ended(db: Database) -> None:
    with db.transaction() as s:
        job = make_job(s, make_user(s).id, "running", entrypoint={"kind": "builtin"}, nodes=3)
        make_node_run(s, job, "running", node_rank=0)
        make_node_run(s, job, "succeeded", node_rank=1)
        make_node_run(s, job, "running", node_rank=2)
        job_id = job.id
    key = NodeKey(job_id=job_id, attempt=1, node_rank=0)
    assert peers_ended_at(db, key) is None  # node 2 still runs
    with db.transaction() as s:
        finish_node(s, job_id, 1, 2, NodeOutcome(state=NodeState.SUCCEEDED, exit_code=0))
    ended = peers_ended_at(db, key)
    assert ended is not None
    assert peers_ended_at(db, NodeKey(job_id=job_id, attempt=1, node_rank=2)) is None  # node 0 runs


def test_a_log_batch_asks_no_stop_of_a_job_nobody_preempts(db: Database) -> None:
    """SQLite 3.40 evaluates `preempting_since IS NOT NULL` as true in an UPDATE's RETURNING
    when the column is NULL: every job that wrote a log was stopped as preempted within seconds.
    A log batch's answer (the stall clock's write) carries a stop grace only while a stop is
    asked of the attempt, on both databases."""
    from datetime import timedelta

    from service.models.base import utcnow

    job_id = running_job(db)
    key = NodeKey(job_id=job_id, attempt=1, node_rank=0)
    logs = Batch(logs=[(0, 0, b"a line\n")])
    control = write_batch(db, key, logs)
    assert control is not None and control.stop_grace_s is None
    with db.transaction() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.preempting_since, job.stop_grace_s = utcnow(), 42
        job.last_report_at = utcnow() - timedelta(hours=1)  # so that this batch writes the clock
    control = write_batch(db, key, Batch(logs=[(0, 7, b"another\n")]))
    assert control is not None and control.stop_grace_s == 42
    assert job_control(db, job_id).stop_grace_s == 42  # type: ignore[union-attr]
