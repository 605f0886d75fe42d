"""Pooled PostgreSQL connections are pinged only after sitting idle (`service.db`): a busy
server spends no round trip per request on it, and a connection that died while idle is
replaced without the caller seeing an error."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from service import db as db_module
from service.config import Settings
from service.db import Database
from service.testing import harness


@pytest.fixture
def database(pg_url: str, tmp_path: Path) -> Iterator[Database]:
    db = Database(Settings(home=tmp_path, database_url=pg_url, broker_url="filesystem://"))
    yield db
    db.dispose()


def _backend_pid(db: Database) -> int:
    with db.read_connection() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _count_pings(db: Database, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    pings: list[int] = []
    real = db.engine.dialect.do_ping

    def counted(dbapi_conn: object) -> bool:
        pings.append(1)
        return bool(real(dbapi_conn))

    monkeypatch.setattr(db.engine.dialect, "do_ping", counted)
    return pings


def test_a_connection_in_use_is_not_pinged(database: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    pings = _count_pings(database, monkeypatch)
    pids = {_backend_pid(database) for _ in range(20)}
    assert len(pids) == 1  # the same pooled connection each time
    assert pings == []


def test_an_idle_connection_is_pinged(database: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(db_module, "PING_AFTER_IDLE_S", 0.2)
    pings = _count_pings(database, monkeypatch)
    _backend_pid(database)
    time.sleep(0.3)
    _backend_pid(database)
    assert pings == [1]


def test_a_connection_that_died_while_idle_is_replaced(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db_module, "PING_AFTER_IDLE_S", 0.2)
    first = _backend_pid(database)
    with psycopg.connect(harness.PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (first,))
    time.sleep(0.3)
    assert _backend_pid(database) != first  # and no error reached the caller
