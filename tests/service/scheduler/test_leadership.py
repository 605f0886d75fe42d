"""Scheduler leadership that cannot split (issue #26), behind a real PgBouncer in transaction
mode: two schedulers pass as fast as they can over a queue that keeps moving, while the
connection that holds the scheduling lock is killed again and again in the middle of passes.
No job is ever placed twice, no slot is held twice, and every job is placed in the end.

Why it holds: the lock is `pg_try_advisory_xact_lock`, taken in the very transaction that
places (`service.scheduler.placement_pass.run_pass`). PgBouncer keeps one transaction on one server
connection, and the lock ends with the transaction: a pass whose connection dies has its
placements rolled back with its lock, so no second leader can ever act on a stale belief.

Needs the `pgbouncer` binary (Debian's package; `.ci/services` installs it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import func, select

from service.config import Settings
from service.db import Database
from service.jobs.states import lock_job, transition_job
from service.migrate import upgrade
from service.models import GpuAllocation, Job, JobEvent, NodeRun, utcnow
from service.scheduler.placement_pass import ADVISORY_KEY, run_pass
from service.states import JobState
from service.testing import harness
from tests.factories import make_job, make_user, make_worker

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
HOSTS, SLOTS, JOBS, KILLS = 12, 4, 240, 12


@pytest.fixture
def pooled_url(pg_url: str) -> Iterator[str]:
    """A PgBouncer in transaction mode in front of the test database; its URL. Its folder is
    outside pytest's (0700) tree: run as root, it drops to `nobody`, who must read it."""
    if not Path(PGBOUNCER).exists():
        pytest.fail("pgbouncer is not installed: run .ci/services")
    folder = Path(tempfile.mkdtemp(prefix="tj-pgbouncer-"))
    folder.chmod(0o755)
    port = harness.free_port()
    user = pg_url.split("://", 1)[1].split("@", 1)[0]
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host=127.0.0.1 port=5432\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\n"
        "auth_type = trust\n"
        f"auth_file = {folder / 'users.txt'}\n"
        "pool_mode = transaction\n"
        "max_client_conn = 200\ndefault_pool_size = 20\n"
    )
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []  # it refuses to run as root
    proc = subprocess.Popen([PGBOUNCER, *as_user, str(folder / "pgbouncer.ini")])
    url = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{port}")
    try:
        harness.wait_for(lambda: _answers(url), 20, "pgbouncer")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, prepare_threshold=None, connect_timeout=2) as conn:
            return conn.execute("SELECT 1").fetchone() == (1,)
    except psycopg.Error:
        return False


def seed(settings: Settings) -> None:
    upgrade(settings)
    db = Database(settings)
    with db.transaction() as s:
        owner = make_user(s, "team")
        for i in range(HOSTS):
            make_worker(s, f"h{i:02d}", gpus=SLOTS)
        for i in range(JOBS):
            make_job(s, owner.id, gpus_per_node=1 if i % 3 else 2, mode="single" if i % 3 else "ddp")
    db.dispose()


def lock_holder(direct: psycopg.Connection) -> int | None:
    row = direct.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND classid = %s AND objid = %s LIMIT 1",
        (ADVISORY_KEY >> 32, ADVISORY_KEY & 0xFFFFFFFF),
    ).fetchone()
    return None if row is None else int(row[0])


def test_two_schedulers_never_double_place_while_the_lock_connection_dies(
    pg_url: str, pooled_url: str, tmp_path: Path
) -> None:
    seed(Settings(home=tmp_path, database_url=pg_url))
    stop = threading.Event()
    passes = [0, 0]
    kills: list[int] = []
    with psycopg.connect(pg_url, autocommit=True) as direct:
        threads = [
            threading.Thread(target=scheduler, args=(tmp_path, pooled_url, stop, passes, 0)),
            threading.Thread(target=scheduler, args=(tmp_path, pooled_url, stop, passes, 1)),
            threading.Thread(target=finisher, args=(tmp_path, pg_url, stop)),
            threading.Thread(target=killer, args=(direct, stop, kills)),
        ]
        for t in threads:
            t.start()
        try:
            harness.wait_for(lambda: len(kills) >= KILLS, 120, f"{KILLS} lock connections killed mid-pass")
            harness.wait_for(lambda: _queued(pg_url) == 0, 120, "every job placed")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)

    assert passes[0] > 0 and passes[1] > 0, passes
    db = Database(Settings(home=tmp_path, database_url=pg_url))
    try:
        with db.read() as s:
            scheduled = s.execute(
                select(JobEvent.job_id, func.count())
                .where(JobEvent.type == "state", JobEvent.data["state"].as_string() == "scheduled")
                .group_by(JobEvent.job_id)
            ).all()
            assert len(scheduled) == JOBS
            assert {n for _, n in scheduled} == {1}  # each job placed exactly once
            runs = s.execute(select(NodeRun.job_id, func.count()).group_by(NodeRun.job_id)).all()
            assert {n for _, n in runs} == {1}
            assert s.execute(select(func.count()).select_from(GpuAllocation)).scalar_one() <= HOSTS * SLOTS
            ended = s.execute(
                select(func.count()).select_from(Job).where(Job.finished_at <= utcnow())
            ).scalar_one()
            assert ended >= JOBS - HOSTS * SLOTS
    finally:
        db.dispose()


def scheduler(home: Path, pooled_url: str, stop: threading.Event, passes: list[int], index: int) -> None:
    """Scheduler `index`: passes through PgBouncer as fast as it can, counted in `passes`."""
    settings = Settings(home=home, database_url=pooled_url, database_pooled=True, heartbeat_timeout_s=3600)
    db = Database(settings)
    try:
        while not stop.is_set():
            run_pass(db, settings, dispatch=lambda _: None)
            passes[index] += 1
    finally:
        db.dispose()


def finisher(home: Path, pg_url: str, stop: threading.Event) -> None:
    """Ends placed jobs, so that the queue keeps moving and passes keep placing."""
    db = Database(Settings(home=home, database_url=pg_url))
    try:
        while not stop.is_set():
            with db.transaction() as s:
                placed = s.execute(select(Job.id).where(Job.state == JobState.SCHEDULED).limit(20)).scalars()
                for job_id in list(placed):
                    job = lock_job(s, job_id)
                    if job is not None and job.state == JobState.SCHEDULED:
                        transition_job(s, job, JobState.RUNNING, "test")
                        transition_job(s, job, JobState.SUCCEEDED, "test")
            time.sleep(0.05)
    finally:
        db.dispose()


def killer(direct: psycopg.Connection, stop: threading.Event, kills: list[int]) -> None:
    """Kills the lock holder's server connection mid-pass, KILLS times, a pass or two apart."""
    while not stop.is_set() and len(kills) < KILLS:
        pid = lock_holder(direct)
        if pid is None:
            time.sleep(0.005)
            continue
        with contextlib.suppress(psycopg.Error):
            direct.execute("SELECT pg_terminate_backend(%s)", (pid,))
        kills.append(pid)
        time.sleep(0.3)


def _queued(pg_url: str) -> int:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM jobs WHERE state = 'queued'").fetchone()
        return int(row[0]) if row else -1
