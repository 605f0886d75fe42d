"""Applying and checking the Alembic migrations in the repository's ``migrations/`` folder."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from service.config import Settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(settings: Settings) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", settings.resolved_database_url.replace("%", "%%"))
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    command.upgrade(alembic_config(settings), revision)


def downgrade(settings: Settings, revision: str = "base") -> None:
    command.downgrade(alembic_config(settings), revision)


def schema_is_current(settings: Settings) -> bool:
    """True when the database is at the newest migration (servers and workers refuse otherwise)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from service.db import make_engine

    head = ScriptDirectory.from_config(alembic_config(settings)).get_current_head()
    engine = make_engine(settings)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision() == head
    finally:
        engine.dispose()
