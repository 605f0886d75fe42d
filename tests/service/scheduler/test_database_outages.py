"""Silence is judged only once the database has been reachable for a whole heartbeat timeout:
a fail-over must not make every worker look lost (issue: no data lost when a process dies)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from service.models import Worker, utcnow
from service.scheduler.outages import DatabaseOutages
from service.scheduler.reaper import reap
from tests.factories import make_worker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_silence_is_judged_a_whole_timeout_after_the_database_is_back() -> None:
    clock = Clock()
    outages = DatabaseOutages(15.0, clock)
    assert not outages.may_judge_silence()  # just started: no whole timeout watched yet
    clock.now += 15
    assert outages.may_judge_silence()
    outages.unreachable()
    clock.now += 60
    assert not outages.may_judge_silence()  # away
    outages.reached()
    clock.now += 14.9
    assert not outages.may_judge_silence()  # back, but the workers have not all been heard yet
    outages.reached()  # later passes do not move the moment it came back
    clock.now += 0.1
    assert outages.may_judge_silence()


@pytest.fixture
def db(tmp_path: Path) -> Database:
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    upgrade(settings)
    return Database(settings)


@pytest.mark.parametrize("judge", [True, False])
def test_a_silent_worker_goes_offline_only_when_silence_may_be_judged(db: Database, judge: bool) -> None:
    with db.transaction() as s:
        make_worker(s, "w1", now=utcnow() - timedelta(seconds=db.settings.heartbeat_timeout_s * 4))
    with db.transaction() as s:
        reap(s, db.settings, judge_silence=judge)
    with db.transaction() as s:
        state = s.execute(select(Worker.state).where(Worker.name == "w1")).scalar_one()
    assert state == ("offline" if judge else "online")
