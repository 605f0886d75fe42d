"""A migrated database of each kind (SQLite and PostgreSQL) for the outbox and delivery tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.db import Database
from service.migrate import upgrade


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    url = (
        f"sqlite:///{tmp_path / 'db.sqlite'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    s = Settings(
        home=tmp_path,
        admin_token="x",
        database_url=url,
        webhook_allow_private=True,
        webhook_backoff_initial_s=0.2,
        webhook_backoff_max_s=0.4,
        webhook_poll_s=0.1,
        webhook_timeout_s=3,
    )
    upgrade(s)
    return s


@pytest.fixture
def db(settings: Settings) -> Iterator[Database]:
    database = Database(settings)
    yield database
    database.dispose()
