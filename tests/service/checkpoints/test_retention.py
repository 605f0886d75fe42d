"""Retention against a real database built by the migrations (PostgreSQL, and SQLite), with
real files in a file:// storage: what it deletes, and what it must never delete."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from service.checkpoints.recording import enforce_retention
from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from service.models import Checkpoint, Job, User
from service.storage import Storage
from tests.factories import make_job


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    settings = Settings(home=tmp_path, database_url=url)
    upgrade(settings)
    database = Database(settings)
    yield database
    database.dispose()


def _job(s: Session, owner: int, state: str, attempt: int = 1, resume: int | None = None) -> Job:
    entry = {"kind": "script", "path": "x.py", "args": []}
    return make_job(s, owner, state, entrypoint=entry, attempt=attempt, resume_checkpoint_id=resume)


def _seed(db: Database, storage: Storage) -> dict[str, int]:
    """Job A, now on attempt 2, with c1..c3 from attempt 1 and c4..c6 from attempt 2; a queued
    job resuming from c1, a finished one that resumed from c2, and an upload."""
    with db.transaction() as s:
        user = User(name="u", token_hash="0" * 64)
        s.add(user)
        s.flush()
        a = _job(s, user.id, "running", attempt=2)
        ids: dict[str, int] = {"job": a.id}
        for n, attempt in enumerate([1, 1, 1, 2, 2, 2], start=1):
            key = f"jobs/{a.id}/attempt-{attempt}/epoch-{n:04d}.pt"
            size, sha = storage.put_stream(iter([f"c{n}".encode()]), key)
            ckpt = Checkpoint(
                owner_id=user.id,
                job_id=a.id,
                attempt=attempt,
                name=f"epoch-{n:04d}.pt",
                epoch=n,
                step=n,
                size_bytes=size,
                sha256=sha,
                storage_key=key,
                metrics={},
            )
            s.add(ckpt)
            s.flush()
            ids[f"c{n}"] = ckpt.id
        size, sha = storage.put_stream(iter([b"up"]), "uploads/1/up.pt")
        upload = Checkpoint(
            owner_id=user.id, name="up.pt", size_bytes=size, sha256=sha, storage_key="uploads/1/up.pt"
        )
        s.add(upload)
        s.flush()
        ids["upload"] = upload.id
        _job(s, user.id, "queued", resume=ids["c1"])
        _job(s, user.id, "succeeded", resume=ids["c2"])
    return ids


def _remaining(db: Database) -> set[int]:
    from sqlalchemy import select

    with db.transaction() as s:
        return set(s.execute(select(Checkpoint.id)).scalars())


def test_keeps_the_newest_and_everything_still_needed(db: Database, tmp_path: Path) -> None:
    storage = Storage(f"file://{tmp_path / 'storage'}")
    ids = _seed(db, storage)
    everything = _remaining(db)

    assert enforce_retention(db, storage, ids["job"], keep_last=0) == []  # 0 keeps all
    assert _remaining(db) == everything

    deleted = enforce_retention(db, storage, ids["job"], keep_last=2)
    # c5, c6: the newest two; c3: what attempt 2 resumed from; c1: a queued job resumes from it;
    # c2: a finished job names it. Only c4 goes — row and file.
    assert deleted == [ids["c4"]]
    assert _remaining(db) == everything - {ids["c4"]}
    assert storage.list(f"jobs/{ids['job']}") == [
        f"jobs/{ids['job']}/attempt-1/epoch-0001.pt",
        f"jobs/{ids['job']}/attempt-1/epoch-0002.pt",
        f"jobs/{ids['job']}/attempt-1/epoch-0003.pt",
        f"jobs/{ids['job']}/attempt-2/epoch-0005.pt",
        f"jobs/{ids['job']}/attempt-2/epoch-0006.pt",
    ]
    assert storage.exists("uploads/1/up.pt")

    assert enforce_retention(db, storage, ids["job"], keep_last=1) == [ids["c5"]]
    assert enforce_retention(db, storage, ids["job"], keep_last=1) == []  # idempotent
    assert enforce_retention(db, storage, 10**6, keep_last=1) == []  # no such job
