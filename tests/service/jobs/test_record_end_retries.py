"""A node's end survives a database that is away when the node ends: PostgreSQL refusing every
connection for a while (as during a restart). Dropped, it would leave the job `running` on a
live worker that no longer runs it, with its GPUs held, for ever."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from service.config import Settings
from service.db import Database
from service.jobs.lifecycle import record_end
from service.migrate import upgrade
from service.models import Job
from service.nodes.values import NodeKey, NodeOutcome
from service.states import NodeState
from service.testing.harness import PG_ADMIN_URL
from tests.factories import make_job, make_node_run, make_user


@pytest.fixture
def db(pg_url: str, tmp_path: Path) -> Iterator[Database]:
    settings = Settings(home=tmp_path, database_url=pg_url)
    upgrade(settings)
    database = Database(settings)
    yield database
    database.dispose()


def _running_job(db: Database) -> int:
    with db.transaction() as s:
        job = make_job(
            s, make_user(s).id, "running", entrypoint={"kind": "script", "path": "x.py", "args": []}
        )
        make_node_run(s, job, "running", address="a")
        return job.id


def _refuse_connections(name: str, refuse: bool) -> None:
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {"false" if refuse else "true"}')
        if refuse:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))


def test_the_end_is_stored_once_the_database_is_back(
    db: Database, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = _running_job(db)
    name = pg_url.rsplit("/", 1)[1]
    _refuse_connections(name, True)
    back = threading.Timer(2.0, _refuse_connections, (name, False))
    back.start()
    try:
        record_end(
            db,
            NodeKey(job_id=job_id, attempt=1, node_rank=0),
            NodeOutcome(state=NodeState.SUCCEEDED, exit_code=0),
        )
    finally:
        back.join()
    assert any("Retrying" in r.getMessage() for r in caplog.records)  # it did meet the refusal
    with db.transaction() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.state == "succeeded" and job.exit_code == 0
