"""Where every checkpoint row is written (a rank's file, stored by its worker, and an upload),
and how many a job keeps.

Both go through `record_checkpoint`: one place decides what a recorded checkpoint is (its row,
and for a job's own file the job's `checkpoint` event in the same transaction). The bytes are
always stored first, outside any transaction; a row whose job has gone takes its file with it.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from sqlalchemy.orm import Session

from service.checkpoints import repository as repo
from service.db import Database
from service.jobs import repository as jobs_repo
from service.jobs.reports import touch_report
from service.jobs.states import append_event
from service.models import Checkpoint
from service.nodes.values import NodeKey
from service.schemas import checkpoint_out
from service.storage import CHUNK, Storage

log = logging.getLogger("torchjobs.checkpoints")


class Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


def record_checkpoint(session: Session, ckpt: Checkpoint) -> Checkpoint:
    """Add the row; a job's checkpoint is announced on its event stream in the same transaction."""
    repo.add(session, ckpt)
    if ckpt.job_id is not None:
        append_event(session, ckpt.job_id, "checkpoint", checkpoint_out(ckpt).model_dump(mode="json"))
    return ckpt


def store_rank_checkpoint(
    db: Database,
    storage: Storage,
    key: NodeKey,
    source: Readable,
    name: str,
    meta: dict[str, Any] | None,
    version: int = 0,
) -> int | None:
    """A file rank 0 wrote: upload it, then record it. None when the job is gone.

    `source` is the file the worker opened and checked (workers/launcher/jobfiles.py), read
    once, hashed on the way: never a path, which the job could point elsewhere meanwhile.

    A name written again (`version` > 0) is stored beside the earlier files of that name, never
    over them: each is a Checkpoint of its own, downloadable and resumable."""
    folder = f"jobs/{key.job_id}/attempt-{key.attempt}" + (f"/v{version}" if version else "")
    storage_key = f"{folder}/{name}"
    size, sha = storage.put_stream(iter(lambda: source.read(CHUNK), b""), storage_key)
    meta = meta or {}
    with db.transaction() as session:
        owner = jobs_repo.owner_of(session, key.job_id)
        if owner is None:
            storage.delete(storage_key)
            return None
        ckpt = Checkpoint(
            owner_id=owner,
            job_id=key.job_id,
            attempt=key.attempt,
            name=name,
            epoch=meta.get("epoch"),
            step=meta.get("step"),
            size_bytes=size,
            sha256=sha,
            storage_key=storage_key,
            metrics=meta.get("metrics") or {},
        )
        ckpt_id = record_checkpoint(session, ckpt).id
        touch_report(session, key)  # a checkpoint is a report: the stall clock starts again
    _retain(db, storage, key.job_id)
    return ckpt_id


def _retain(db: Database, storage: Storage, job_id: int) -> None:
    keep_last = db.settings.checkpoint_keep_last
    if not keep_last:
        return
    try:
        enforce_retention(db, storage, job_id, keep_last)
    except Exception:  # retention is housekeeping: it must never fail the recording
        log.exception("job %s: checkpoint retention failed", job_id)


def enforce_retention(db: Database, storage: Storage, job_id: int, keep_last: int) -> list[int]:
    """Keep a job's newest `keep_last` checkpoints (0 keeps all) and whatever is still needed
    (see `repository.retention_candidates`); delete the rest. Returns the deleted ids.

    Rows go first, in one transaction; their files only after it commits, so a failure leaves
    at worst an unreferenced file, never a record whose bytes are gone.
    """
    if keep_last <= 0:
        return []
    deleted: list[tuple[int, str]] = []
    with db.transaction() as session:
        for ckpt in repo.retention_candidates(session, job_id, keep_last):
            if repo.delete_unreferenced(session, ckpt):
                deleted.append((ckpt.id, ckpt.storage_key))
    for ckpt_id, key in deleted:
        try:
            storage.delete(key)
        except Exception:  # the row is gone; a stray file is only wasted space
            log.exception("retention: could not delete %s of checkpoint %s", key, ckpt_id)
    if deleted:
        log.info("job %s: retention removed checkpoints %s", job_id, [i for i, _ in deleted])
    return [i for i, _ in deleted]
