"""Engine and sessions.

One engine per process. SQLite (the embedded setup) is shared by the API server and the
worker processes, so it runs in WAL mode with a busy timeout, and every transaction is
``BEGIN IMMEDIATE``: writers queue up instead of failing half-way with "database is locked".
On PostgreSQL transactions are ordinary; row locks serialise what must be serialised.

Reads that never write (the open streams' short look-ups, GET requests) go through `read()` or
`read_sessionmaker`: on SQLite those begin DEFERRED, so two hundred streams re-reading do not
queue behind the writers' lock; on PostgreSQL they run in autocommit, which saves the BEGIN and
COMMIT round trips and sees exactly what a READ COMMITTED transaction would (each statement
takes its own snapshot either way).

Every session made here publishes, after it commits, which jobs got new events or log chunks
(`service.wakeups`): that is how open streams in the API process learn to read again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.wakeups.publish import install_publisher

READ_ONLY_OPTION = "torchjobs_read_only"
# Connections per process: up to POOL_SIZE kept open once used, POOL_OVERFLOW more under load.
# An overflow connection is closed when it is returned, so a load that needs more than the
# kept ones connects again and again (measured: 32 clients listing jobs on PostgreSQL spent a
# tenth of the server's CPU opening connections with 10 kept). The thread pool runs 40 at most.
POOL_SIZE = 30
POOL_OVERFLOW = 10
# Connections that request sessions leave to the process's other users (the scheduler thread,
# the streams' short reads, the publisher): see `Database.request_sessions_max`.
POOL_RESERVED = 4
# A pooled PostgreSQL connection is pinged (a round trip, and a wake-up of its server process)
# before it is used only when it sat unused this long: under load every request took one, as
# many round trips as the list's own query (a sixth of the list's samples under py-spy).
# A connection used within the last second that has died since fails its statement instead;
# SQLAlchemy then invalidates the whole pool, so the requests after it reconnect.
PING_AFTER_IDLE_S = 1.0


def _setup_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        read_only = conn.get_execution_options().get(READ_ONLY_OPTION, False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def make_engine(settings: Settings) -> Engine:
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        db_path = url.split("///", 1)[-1]
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"timeout": 30, "check_same_thread": False},
            pool_size=POOL_SIZE,
            max_overflow=POOL_OVERFLOW,
        )
        _setup_sqlite(engine)
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    # Behind PgBouncer in transaction mode psycopg must not prepare statements: the next
    # transaction may run on another server connection, which never saw them.
    connect_args: dict[str, Any] = {"prepare_threshold": None} if settings.database_pooled else {}
    engine = create_engine(url, pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW, connect_args=connect_args)
    _ping_when_idle(engine)
    return engine


def _ping_when_idle(engine: Engine) -> None:
    """`pool_pre_ping`, for connections idle longer than `PING_AFTER_IDLE_S` only."""

    def _mark(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info["used_at"] = time.monotonic()

    event.listen(engine.pool, "connect", _mark)
    event.listen(engine.pool, "checkin", _mark)

    @event.listens_for(engine.pool, "checkout")
    def _ping(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.get("used_at", float("-inf")) < PING_AFTER_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # the pool drops this connection and takes a fresh one
            raise DisconnectionError(str(exc)) from exc


def unavailable_reason(exc: DBAPIError) -> str:
    """The driver's first line ("connection failed: … not currently accepting connections"):
    what a log needs of a database that is away, without SQLAlchemy's statement and link."""
    return str(exc.orig or exc).splitlines()[0][:300]


class Database:
    """Owns the engine and hands out sessions; passed explicitly, never a module global."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = make_engine(settings)
        self.sessionmaker = sessionmaker(self.engine, expire_on_commit=False)
        self.read_engine = self._read_engine()
        self.read_sessionmaker = sessionmaker(self.read_engine, expire_on_commit=False)
        self.publisher = install_publisher(self.sessionmaker, settings)

    def _read_engine(self) -> Engine:
        options: dict[str, object] = {READ_ONLY_OPTION: True}
        if self.engine.dialect.name == "postgresql":
            options["isolation_level"] = "AUTOCOMMIT"
        return self.engine.execution_options(**options)

    @property
    def request_sessions_max(self) -> int:
        """How many request-scoped sessions may exist at once (`service.api.deps`): fewer than
        the pool's connections, so a request that holds one always gets a connection."""
        return POOL_SIZE + POOL_OVERFLOW - POOL_RESERVED

    @property
    def is_postgres(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One unit of work: commit on success, roll back on any error."""
        with self.sessionmaker() as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A short read-only transaction (never writes; on SQLite it takes no write lock)."""
        with self.read_sessionmaker() as session, session.begin():
            yield session

    @contextmanager
    def read_connection(self) -> Iterator[Connection]:
        """`read()` without a session, for Core queries on the hottest routes: the session's
        own bookkeeping cost more than their one indexed query."""
        with self.read_engine.connect() as conn, conn.begin():
            yield conn

    def dispose(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.engine.dispose()


class KeptConnection:
    """One database connection kept from one transaction to the next: a running node's.

    A connection taken from the pool is pinged first (on PostgreSQL a round trip of its own);
    a node stores a batch every half second, for hours, so it keeps one. A transaction that
    fails drops it, and the next takes a fresh one from the pool: the supervisor keeps
    whatever could not be stored meanwhile."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.conn: Connection | None = None

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        if self.conn is None:
            self.conn = self.db.engine.connect()
        try:
            with self.db.sessionmaker(bind=self.conn) as session, session.begin():
                yield session
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a connection already broken
                conn.close()
