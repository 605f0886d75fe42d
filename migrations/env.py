"""Alembic environment: the URL comes from torchjobs Settings unless the caller set one."""

from __future__ import annotations

from alembic import context

from service.config import Settings
from service.db import make_engine
from service.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    url = config.get_main_option("sqlalchemy.url")
    settings = Settings(database_url=url) if url else Settings()
    engine = make_engine(settings)
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # A batch migration rebuilds a table (copy, DROP, rename); with foreign keys on, the
        # DROP would cascade into every table that points at it. Off on the driver connection
        # itself, before any transaction (SQLite ignores the pragma inside one), and checked
        # after.
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=sqlite,
        compare_type=True,
    )
    try:
        with context.begin_transaction():
            context.run_migrations()
    finally:
        if sqlite:
            raw = connection.connection.driver_connection
            broken = raw.execute("PRAGMA foreign_key_check").fetchall()
            raw.execute("PRAGMA foreign_keys=ON")
            if broken:
                raise RuntimeError(f"the migration left rows that break a foreign key: {broken[:5]}")


run_migrations_online()
