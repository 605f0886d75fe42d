"""The Alembic migrations build exactly the schema the models declare, on both databases."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from sqlalchemy import create_engine, inspect

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


def test_migrations_match_models_on_postgresql(pg_url: str) -> None:
    check_round_trip(Settings(database_url=pg_url))


def test_migrations_match_models_on_sqlite(tmp_path: Path) -> None:
    check_round_trip(Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}"))
