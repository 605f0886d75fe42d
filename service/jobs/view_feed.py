"""What keeps the job-view cache (`service.jobs.view_cache`) honest: a feed of changes.

* PostgreSQL: triggers on every table a job view reads (migration 0002; new jobs, for the
  list's pages, 0011) `pg_notify` the channel `torchjobs_views` with `j<job id>` (jobs, node
  runs, attempts, checkpoints) or `u`
  (users: a rotated or revoked token, a renamed owner). One connection per API process
  LISTENs; the cache is on only while it does. PostgreSQL delivers a notification when the
  writer commits, so a worker's commit reaches the cache within the delivery time of one
  NOTIFY (see docs/benchmarks.md), and entries expire after the TTL in any case.
* SQLite (the embedded setup): `PRAGMA data_version` changes whenever another connection
  commits. It is read before every look-up, so a look-up never serves a view older than the
  last commit made before it began.
* This process's own commits clear the cache as they commit (`install_commit_invalidation`):
  a client reads its own cancel, upload or token rotation on its very next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from typing import Any

from sqlalchemy import TextClause, event
from sqlalchemy.orm import ORMExecuteState, Session, sessionmaker

from service.db import Database
from service.jobs.view_cache import WROTE, ViewCache

log = logging.getLogger("torchjobs.view_cache")

CHANNEL = "torchjobs_views"
# The triggers of migrations 0002 and 0011; without every one of them the cache stays off.
TRIGGERS = (
    "torchjobs_view_jobs",
    "torchjobs_view_jobs_insert",
    "torchjobs_view_node_runs",
    "torchjobs_view_job_attempts",
    "torchjobs_view_checkpoints",
    "torchjobs_view_users",
)
RECONNECT_MAX_S = 5.0
# Dead-peer detection for the LISTEN connection (libpq options): a host that vanishes
# without closing the socket is noticed in about 11 s, and entries expire meanwhile anyway.
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}


def apply_notification(cache: ViewCache, payload: str) -> None:
    if payload.startswith("j") and payload[1:].isdigit():
        cache.invalidate_job(int(payload[1:]))
    else:
        cache.invalidate_all()  # `u`, or anything this version does not know


class PostgresViewFeed:
    """LISTENs on its own connection (psycopg, on the event loop) and reconnects for ever."""

    def __init__(self, dsn: str, cache: ViewCache) -> None:
        self.dsn, self.cache = dsn, cache

    async def run(self) -> None:
        import psycopg

        backoff = 0.5
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.dsn, autocommit=True, **KEEPALIVES
                ) as conn:
                    if not await self._triggers_installed(conn):
                        log.warning(
                            "job-view cache off: the database lacks its triggers (run `torchjobs db upgrade`)"
                        )
                        return
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self.cache.enable()
                    backoff = 0.5
                    async for note in conn.notifies():
                        apply_notification(self.cache, note.payload)
            except (psycopg.Error, OSError) as exc:
                log.warning("job-view cache off: change feed lost (%s); retrying in %.1fs", exc, backoff)
            finally:
                self.cache.disable()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_MAX_S)

    @staticmethod
    async def _triggers_installed(conn: Any) -> bool:
        cur = await conn.execute(
            "SELECT count(DISTINCT tgname) FROM pg_trigger WHERE tgname = ANY(%s)", (list(TRIGGERS),)
        )
        row = await cur.fetchone()
        return row is not None and row[0] == len(TRIGGERS)


class SqliteDataVersion:
    """Called before each look-up, on the event loop: an integer read from SQLite's shared
    WAL index, no disk I/O. Any commit by another connection changes it."""

    def __init__(self, path: str, cache: ViewCache) -> None:
        self.cache = cache
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._seen: int | None = None

    def __call__(self) -> None:
        try:
            version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        except sqlite3.Error:
            version = None  # unknown: nothing cached can be trusted
        if version is None or version != self._seen:
            self.cache.invalidate_all()
        self._seen = version

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()


def install_commit_invalidation(factory: sessionmaker[Session], cache: ViewCache) -> None:
    """A transaction of this process that wrote anything clears the cache when it commits.
    Read-only passes (a scheduler tick that placed nothing) leave it alone."""

    @event.listens_for(factory, "after_flush")
    def _flushed(session: Session, _context: Any) -> None:
        session.info[WROTE] = True

    @event.listens_for(factory, "do_orm_execute")
    def _executed(state: ORMExecuteState) -> None:
        if _may_write(state):
            state.session.info[WROTE] = True

    @event.listens_for(factory, "after_commit")
    def _committed(session: Session) -> None:
        if not session.in_nested_transaction() and session.info.pop(WROTE, False):
            cache.invalidate_all()

    @event.listens_for(factory, "after_transaction_end")
    def _ended(session: Session, transaction: Any) -> None:
        if transaction.parent is None:  # a rolled-back write never reached anyone
            session.info.pop(WROTE, None)


def _may_write(state: ORMExecuteState) -> bool:
    """Textual SQL counts as a write unless it is a SELECT (the scheduler's advisory lock is
    one, every pass: it must not empty the cache each second)."""
    statement = state.statement
    if isinstance(statement, TextClause):
        return statement.text.lstrip()[:6].upper() != "SELECT"
    return not state.is_select


class ViewFeed:
    """The cache and the feed that keeps it, started and stopped with the app."""

    def __init__(self, db: Database, cache: ViewCache) -> None:
        self.db, self.cache = db, cache
        self._task: asyncio.Task[None] | None = None
        self._sqlite: SqliteDataVersion | None = None

    async def start(self) -> None:
        if self.cache.ttl_s <= 0:
            return  # configured off
        install_commit_invalidation(self.db.sessionmaker, self.cache)
        url = self.db.engine.url
        settings = self.db.settings
        if self.db.is_postgres and settings.database_pooled and not settings.database_direct_url:
            log.warning(
                "job-view cache off: LISTEN needs a session, and the database is pooled "
                "(set TORCHJOBS_DATABASE_DIRECT_URL to a direct connection to turn it on)"
            )
        elif self.db.is_postgres:
            dsn = settings.database_direct_url or url.set(drivername="postgresql").render_as_string(
                hide_password=False
            )
            feed = PostgresViewFeed(dsn.replace("postgresql+psycopg://", "postgresql://", 1), self.cache)
            self._task = asyncio.create_task(feed.run(), name="torchjobs-view-feed")
        elif url.database and url.database != ":memory:":
            self._sqlite = SqliteDataVersion(url.database, self.cache)
            self.cache.poll = self._sqlite
            self.cache.enable()

    async def stop(self) -> None:
        self.cache.disable()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._sqlite is not None:
            self._sqlite.close()
