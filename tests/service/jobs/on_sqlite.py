"""The in-process API on a fresh SQLite database with registered workers, and the scheduler's
pass run by hand: what the `depends_on` and sweep tests drive (contract §10)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from service.scheduler.placement_pass import run_pass
from tests.factories import make_worker, set_job_state


def settings_with_worker(home: Path, token: str, gpus: int) -> Settings:
    """Migrated, with one online worker `w1` of `gpus` slots that is never judged silent."""
    settings = Settings(home=home, admin_token=token, heartbeat_timeout_s=3600)
    upgrade(settings)
    with Database(settings).transaction() as session:
        make_worker(session, "w1", gpus=gpus)
    return settings


@contextmanager
def api_client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, scheduler=False)) as client:
        yield client


def schedule(settings: Settings) -> None:
    """One scheduling pass, its messages dropped (no worker runs anything here)."""
    db = Database(settings)
    run_pass(db, settings, dispatch=lambda _: None)
    db.dispose()


def move(settings: Settings, job_id: int, *states: str) -> None:
    """The job through `states`, one gate move per transaction, as its nodes would report."""
    db = Database(settings)
    for state in states:
        with db.transaction() as s:
            set_job_state(s, job_id, state)
    db.dispose()
