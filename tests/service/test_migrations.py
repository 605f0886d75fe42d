"""The Alembic migrations build exactly the schema the models declare, on both databases."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect, text

from service.config import Settings
from service.migrate import alembic_config, downgrade, upgrade
from service.models import Base


def check_round_trip(settings: Settings) -> None:
    upgrade(settings)
    command.check(alembic_config(settings))  # raises if autogenerate finds any difference
    url = settings.resolved_database_url.replace("postgresql://", "postgresql+psycopg://")
    engine = create_engine(url)
    assert set(inspect(engine).get_table_names()) >= set(Base.metadata.tables)
    engine.dispose()
    downgrade(settings)
    engine = create_engine(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()


def test_migrations_match_models_on_postgresql(empty_pg_url: str) -> None:
    check_round_trip(Settings(database_url=empty_pg_url))


def test_migrations_match_models_on_sqlite(tmp_path: Path) -> None:
    check_round_trip(Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}"))


def history(url: str) -> tuple[int, int, int, int]:
    engine = create_engine(url)
    with engine.connect() as conn:
        counts = tuple(
            conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
            for table in ("jobs", "job_events", "job_attempts", "node_runs")
        )
    engine.dispose()
    return counts  # type: ignore[return-value]


def seed_history(url: str) -> None:
    """One job with its first event, its attempt and a node run, as a 0008 database holds them."""
    engine = create_engine(url)
    with engine.begin() as conn:
        user = "INSERT INTO users (name, token_hash, is_admin, created_at) VALUES ('u', 'h', true, :t)"
        conn.execute(text(user), {"t": "2026-12-01"})
        conn.execute(
            text(
                "INSERT INTO jobs (owner_id, state, mode, nodes, gpus_per_node, entrypoint, env, labels, "
                "max_retries, priority, attempt, last_event_seq, created_at, queued_at) VALUES "
                "(1, 'running', 'single', 1, 1, '{}', '{}', '{}', 0, 0, 1, 1, '2026-12-01', '2026-12-01')"
            )
        )
        event = "INSERT INTO job_events (job_id, seq, ts, type, data) VALUES (1, 1, :t, 'state', '{}')"
        conn.execute(text(event), {"t": "2026-12-01"})
        conn.execute(text("INSERT INTO job_attempts (job_id, attempt) VALUES (1, 1)"))
        conn.execute(
            text(
                "INSERT INTO node_runs (job_id, attempt, node_rank, worker_name, gpus, address, state, "
                "created_at) VALUES (1, 1, 0, 'w', '[0]', '127.0.0.1', 'running', '2026-12-01')"
            )
        )
    engine.dispose()


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_upgrading_a_database_that_holds_jobs_keeps_their_history(
    database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A table rebuilt by a batch migration on SQLite (copy, DROP, rename) must not take the
    rows that point at it with it through their cascading keys: every upgrade from 0008, and
    the way back, keeps every job's events, attempts and node runs."""
    url = (
        f"sqlite:///{tmp_path / 'db.sqlite'}"
        if database == "sqlite"
        else request.getfixturevalue("empty_pg_url")
    )
    settings = Settings(database_url=url)
    upgrade(settings, "0008")
    engine_url = url.replace("postgresql://", "postgresql+psycopg://")
    seed_history(engine_url)
    assert history(engine_url) == (1, 1, 1, 1)
    upgrade(settings)
    assert history(engine_url) == (1, 1, 1, 1)
    downgrade(settings, "0008")
    assert history(engine_url) == (1, 1, 1, 1)
