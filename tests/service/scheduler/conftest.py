"""A scheduler's database of either kind, migrated, for the modules here that run whole passes
on both (a module's own `db` fixture, where it has one, is used instead)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.db import Database
from service.migrate import upgrade


@pytest.fixture(params=["postgres", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    url = (
        f"sqlite:///{tmp_path / 'db.sqlite'}"
        if request.param == "sqlite"
        else str(request.getfixturevalue("pg_url"))
    )
    settings = Settings(home=tmp_path, database_url=url, heartbeat_timeout_s=3600, rendezvous_timeout_s=3600)
    upgrade(settings)
    database = Database(settings)
    yield database
    database.dispose()
