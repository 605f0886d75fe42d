"""Queue positions: by priority then age, the same whether asked for one job or a page."""

from __future__ import annotations

from pathlib import Path

from service.config import Settings
from service.db import Database
from service.jobs.repository import queue_positions
from service.migrate import upgrade
from service.models import User
from tests.factories import make_job


def test_positions_follow_priority_then_age(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, admin_token="x")
    upgrade(settings)
    db = Database(settings)
    with db.transaction() as session:
        user = User(name="u", token_hash="h", is_admin=False)
        session.add(user)
        session.flush()
        jobs = []
        for priority, state in [(0, "queued"), (5, "queued"), (0, "running"), (0, "queued"), (5, "queued")]:
            job = make_job(session, user.id, state, entrypoint={"kind": "builtin"}, priority=priority)
            jobs.append(job)
        session.flush()
        together = queue_positions(session, jobs)
        one_by_one = {j.id: queue_positions(session, [j])[j.id] for j in jobs if j.state == "queued"}
    db.dispose()
    expected = {jobs[1].id: 1, jobs[4].id: 2, jobs[0].id: 3, jobs[3].id: 4}
    assert together == expected == one_by_one
