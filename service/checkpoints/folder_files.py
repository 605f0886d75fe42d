"""Serving a checkpoint's files (contract §11): the list, one file, and a folder's tar.

A file checkpoint is served here as a folder of one: its listing has one item whose path is the
checkpoint's name (node rank 0), and `files/NAME` is the same bytes as its download. A folder
checkpoint's rows are read in one short transaction and the bytes streamed afterwards, outside
any (see `service.checkpoints.service`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session

from service.checkpoints import repository as repo
from service.checkpoints.manifest import folder_name, sorted_rows, unsafe_path_reason
from service.checkpoints.schemas import CheckpointFileList, CheckpointFileOut
from service.checkpoints.service import DownloadPlan, check_stored, plan_bytes
from service.checkpoints.tar_stream import TarFile, archive_size
from service.db import Database
from service.errors import Conflict, NotFound
from service.models import Checkpoint
from service.storage import Storage

log = logging.getLogger("torchjobs.checkpoints")
MAX_PATH = 1024  # checkpoint_files.path's width: a longer one names nothing


@dataclass(frozen=True)
class ServedFile:
    path: str
    size_bytes: int
    sha256: str
    node_rank: int
    storage_key: str


def is_folder(ckpt: Checkpoint) -> bool:
    return ckpt.kind == "folder"


def served_files(session: Session, ckpt: Checkpoint) -> list[ServedFile]:
    """The checkpoint's files in manifest order."""
    if not is_folder(ckpt):
        return [ServedFile(ckpt.name, ckpt.size_bytes, ckpt.sha256, 0, ckpt.storage_key)]
    rows = repo.files_of(session, ckpt.id)
    return [ServedFile(r.path, r.size_bytes, r.sha256, r.node_rank, r.storage_key) for r in sorted_rows(rows)]


def list_files(session: Session, ckpt: Checkpoint) -> CheckpointFileList:
    items = [
        CheckpointFileOut(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256, node_rank=f.node_rank)
        for f in served_files(session, ckpt)
    ]
    return CheckpointFileList(items=items)


def find_file(db: Database, ckpt: Checkpoint, path: str) -> ServedFile:
    """One file by its path, in a short read of its own; an unknown path is a 404."""
    if not is_folder(ckpt):
        if path != ckpt.name:
            raise NotFound("checkpoint file")
        return ServedFile(ckpt.name, ckpt.size_bytes, ckpt.sha256, 0, ckpt.storage_key)
    if not path or len(path) > MAX_PATH or "\0" in path:
        raise NotFound("checkpoint file")  # no row can hold it (and PostgreSQL refuses a NUL)
    with db.read() as session:
        row = repo.file_at(session, ckpt.id, path)
        if row is None:
            raise NotFound("checkpoint file")
        return ServedFile(row.path, row.size_bytes, row.sha256, row.node_rank, row.storage_key)


def load_files(db: Database, ckpt: Checkpoint) -> list[ServedFile]:
    with db.read() as session:
        return served_files(session, ckpt)


async def plan_file(
    storage: Storage,
    ckpt: Checkpoint,
    served: ServedFile,
    *,
    range_header: str | None,
    if_range: str | None,
    if_none_match: str | None,
) -> DownloadPlan:
    """As `plan_download`, for one file: its stored size checked first (404 gone, 409 changed)."""
    await check_stored(storage, ckpt.id, served.storage_key, served.size_bytes, "checkpoint file")
    return plan_bytes(
        size=served.size_bytes,
        sha256=served.sha256,
        modified=ckpt.created_at,
        filename=served.path.rsplit("/", 1)[-1],
        range_header=range_header,
        if_range=if_range,
        if_none_match=if_none_match,
    )


@dataclass(frozen=True)
class TarPlan:
    plan: DownloadPlan
    root: str
    files: list[TarFile]


def plan_tar(
    ckpt: Checkpoint,
    served: list[ServedFile],
    *,
    range_header: str | None,
    if_range: str | None,
    if_none_match: str | None,
) -> TarPlan:
    """The tar of a folder checkpoint: its length from the rows alone (`tar_stream`), its
    checksum header the checkpoint's own `sha256` (the manifest's), as is its ETag.

    A stored path that could not be a member inside `NAME/` is a 409: the archive is never made
    with it (the listing still shows it, as data)."""
    for f in served:
        reason = unsafe_path_reason(f.path)
        if reason is not None:
            log.error("checkpoint %s: refusing to archive %r: %s", ckpt.id, f.path, reason)
            raise Conflict(f"the checkpoint holds a file the archive cannot name: {reason}")
    root = folder_name(ckpt.name, ckpt.id)
    files = [TarFile(f.path, f.size_bytes, f.storage_key) for f in served]
    plan = plan_bytes(
        size=archive_size(root, files),
        sha256=ckpt.sha256,
        modified=ckpt.created_at,
        filename=f"{root}.tar",
        range_header=range_header,
        if_range=if_range,
        if_none_match=if_none_match,
    )
    return TarPlan(plan=plan, root=root, files=files)
