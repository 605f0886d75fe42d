"""The scheduler slows its timed passes only while no job waits for one."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from service.scheduler.thread import has_waiting_work
from tests.factories import make_job, make_node_run, make_user


@pytest.mark.parametrize(
    ("job_state", "node_state", "waiting"),
    [
        ("running", "running", False),  # a job trains: nothing for a pass to do
        ("succeeded", "succeeded", False),
        ("queued", None, True),  # capacity may free at any time
        ("cancelling", "running", True),  # its nodes to close once they stop
        ("scheduled", "pending", True),  # placed, not yet claimed: may need re-sending
    ],
)
def test_waiting_work(tmp_path: Path, job_state: str, node_state: str | None, waiting: bool) -> None:
    settings = Settings(home=tmp_path, admin_token="x")
    upgrade(settings)
    db = Database(settings)
    try:
        assert has_waiting_work(db) is False  # an empty database
        with db.transaction() as session:
            user = make_user(session)
            job = make_job(session, user.id, job_state)
            if node_state is not None:
                make_node_run(session, job, node_state)
        assert has_waiting_work(db) is waiting
    finally:
        db.dispose()
