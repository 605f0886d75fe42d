"""Where every checkpoint row is written (a rank's file, stored by its worker, and an upload),
and how many a job keeps.

Both go through `record_checkpoint`: one place decides what a recorded checkpoint is (its row,
and for a job's own file the job's `checkpoint` event in the same transaction). The bytes are
always stored first, outside any transaction; a row whose job has gone takes its file with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from sqlalchemy.orm import Session

from service.checkpoints import repository as repo
from service.db import Database
from service.errors import Conflict, NotFound
from service.jobs import repository as jobs_repo
from service.jobs.reports import touch_report
from service.jobs.states import append_event
from service.models import Checkpoint, User
from service.nodes.values import NodeKey
from service.schemas import checkpoint_out
from service.states import JobState
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
    retain(db, storage, key.job_id)
    return ckpt_id


def retain(db: Database, storage: Storage, job_id: int) -> None:
    """After a new checkpoint: the job's `keep_checkpoints` (contract §11), else the worker's
    `TORCHJOBS_CHECKPOINT_KEEP_LAST`; neither set keeps all.

    Housekeeping, run after the checkpoint's own transaction has committed: it never raises.
    A caller that saw it raise would take its recorded (or listed) checkpoint for a failed one
    and try it again: a file recorded twice, or a folder's part, already listed and gone,
    awaited until the node's end. What it leaves, the next checkpoint's retention takes."""
    try:
        with db.read() as session:
            job = jobs_repo.job_by_id(session, job_id)
            keep = job.keep_checkpoints if job is not None else None
        keep_last = keep or db.settings.checkpoint_keep_last
        if keep_last:
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
    deleted: list[tuple[int, list[str]]] = []
    with db.transaction() as session:
        for ckpt in repo.retention_candidates(session, job_id, keep_last):
            keys = object_keys(session, ckpt)
            if repo.delete_unreferenced(session, ckpt):
                repo.delete_files_of(session, ckpt.id)
                deleted.append((ckpt.id, keys))
        deleted = [(i, unreferenced_in(session, keys)) for i, keys in deleted]
    for ckpt_id, keys in deleted:
        delete_objects(storage, keys, ckpt_id)
    if deleted:
        log.info("job %s: retention removed checkpoints %s", job_id, [i for i, _ in deleted])
    return [i for i, _ in deleted]


def object_keys(session: Session, ckpt: Checkpoint) -> list[str]:
    """Every object a checkpoint holds: its file's, or each file's of a folder (contract §11)."""
    if ckpt.kind != "folder":
        return [ckpt.storage_key]
    return repo.file_keys_of(session, ckpt.id)


def unreferenced_in(session: Session, keys: Sequence[str]) -> list[str]:
    """Those of `keys` that no listed checkpoint's file holds, nor a folder part still waiting
    (another node's stored part may go into the next checkpoint of its name)."""
    held = repo.held_keys(session, keys)
    prefixes = repo.part_prefixes(session) if keys else []
    return [k for k in keys if k not in held and not any(k.startswith(p) for p in prefixes)]


def delete_objects(storage: Storage, keys: Sequence[str], ckpt_id: int) -> None:
    for key in keys:
        try:
            storage.delete(key)
        except Exception:  # the row is gone; a stray file is only wasted space
            log.exception("could not delete %s of checkpoint %s", key, ckpt_id)


WILL_RESUME = (JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING)


def delete_checkpoint(db: Database, storage: Storage, user: User, ckpt_id: int) -> None:
    """`DELETE /v1/checkpoints/{id}` (contract §11): the owner's (or the admin's) checkpoint,
    its row and then its objects. 404 when it is not theirs; 409 while a queued or running job
    will resume from it: one that names it, or its own job, whose next attempt resumes from
    its newest. A finished job that resumed from it keeps its `resume_from`, not the link."""
    with db.transaction() as session:
        ckpt = repo.get(session, ckpt_id, None if user.is_admin else user.id)
        if ckpt is None:
            raise NotFound("checkpoint")
        if _needed(session, ckpt):
            raise Conflict(f"checkpoint {ckpt_id}: a queued or running job will resume from it")
        keys = object_keys(session, ckpt)
        repo.unlink_resumers(session, ckpt.id)
        repo.delete_files_of(session, ckpt.id)
        repo.delete_row(session, ckpt.id)
        keys = unreferenced_in(session, keys)
    delete_objects(storage, keys, ckpt_id)


def _needed(session: Session, ckpt: Checkpoint) -> bool:
    if repo.lock_resumer(session, ckpt.id, WILL_RESUME) is not None:
        return True
    if ckpt.job_id is None:
        return False
    own = jobs_repo.state_of(session, ckpt.job_id)
    return own in WILL_RESUME and repo.latest_id_of_job(session, ckpt.job_id) == ckpt.id
