"""Two API servers' schedulers placing at once on one database (contract §9): no user's
gpu_quota and no GPU slot is ever over-committed. Real PostgreSQL (its advisory lock) and
SQLite (its single writer); every placement pass is followed by a check of every row."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from sqlalchemy import func, select

from service.config import Settings
from service.db import Database
from service.jobs.states import lock_job, transition_job
from service.migrate import upgrade
from service.models import GpuAllocation, Job, User
from service.scheduler.placement_pass import run_pass
from service.states import JobState
from tests.factories import make_job, make_worker

QUOTAS = {"alice": 2, "bob": 3, "carl": None}
PASSES = 500  # per scheduler: 1,000 in all
ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "digits"}


def seed(db: Database) -> dict[int, int | None]:
    with db.transaction() as s:
        for i in range(4):
            make_worker(s, f"w{i}", gpus=2)
        quotas = {}
        for name, quota in QUOTAS.items():
            user = User(name=name, token_hash=name * 4, gpu_quota=quota)
            s.add(user)
            s.flush()
            quotas[user.id] = quota
            for i in range(60):
                make_job(s, user.id, "queued", entrypoint=ENTRY, gpus_per_node=1 + i % 2, mode="ddp")
    return quotas


def over_commits(db: Database, quotas: dict[int, int | None]) -> list[str]:
    with db.transaction() as s:
        held = dict(
            s.execute(
                select(Job.owner_id, func.count())
                .join(GpuAllocation, GpuAllocation.job_id == Job.id)
                .group_by(Job.owner_id)
            ).all()
        )
    return [
        f"user {o} holds {n} > {quotas[o]}"
        for o, n in held.items()
        if quotas[o] is not None and n > quotas[o]
    ]


def finish_some(db: Database, rng: random.Random) -> None:
    """Jobs end now and then, so the schedulers keep placing."""
    with db.transaction() as s:
        placed = s.execute(select(Job.id).where(Job.state == JobState.SCHEDULED)).scalars().all()
        # in id order, as the scheduler locks: two of these never wait on each other in a circle
        for job_id in sorted(rng.sample(list(placed), k=min(len(placed), rng.randint(0, 2)))):
            job = lock_job(s, job_id)
            if job is not None and job.state == JobState.SCHEDULED:
                transition_job(s, job, JobState.CANCELLING, "a test ends it")
                transition_job(s, job, JobState.CANCELLED, "a test ends it")


@pytest.fixture(params=["postgres", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db.sqlite'}"
    return str(request.getfixturevalue("pg_url"))


def test_two_schedulers_never_over_commit_a_quota_or_a_gpu(url: str, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, database_url=url, heartbeat_timeout_s=3600, rendezvous_timeout_s=3600)
    upgrade(settings)
    first, second = Database(settings), Database(settings)
    quotas = seed(first)
    violations: list[str] = []
    placed = [0, 0]

    errors: list[BaseException] = []

    def scheduler(db: Database, index: int) -> None:
        rng = random.Random(index)
        try:
            for _ in range(PASSES):
                placed[index] += len(run_pass(db, settings, dispatch=lambda _: None))
                violations.extend(over_commits(db, quotas))
                finish_some(db, rng)
        except BaseException as exc:  # a thread's error must fail the test, not only warn
            errors.append(exc)

    threads = [threading.Thread(target=scheduler, args=(db, i)) for i, db in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert violations == []
    assert sum(placed) > 100, placed  # they really placed, again and again
    with first.transaction() as s:
        slots = s.execute(select(GpuAllocation.worker_name, GpuAllocation.gpu_index)).all()
    assert len(slots) == len(set(slots)) <= 8
    first.dispose()
    second.dispose()
