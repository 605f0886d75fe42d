"""A user's own folder checkpoint, uploaded as a tar or a gzip tar (contract §11).

The body is received to a local file first (constant memory, `TORCHJOBS_MAX_UPLOAD_BYTES`:
413 past it), then read twice, never unpacked onto a disk:

1. every member header is checked as a code archive's are (`service.code.archive.check_member`:
   absolute paths, `..`, hard links, devices, fifos, special members), and more strictly: a
   folder checkpoint keeps regular files only (§11), so any symbolic link is refused too, as
   are two members with one path and a file that another member uses as a folder. Past
   `TORCHJOBS_MAX_UPLOAD_BYTES` unpacked or `TORCHJOBS_MAX_CODE_MEMBERS` members is refused.
   The first refusal is a 422 naming the member, and nothing of the archive is kept;
2. each regular file is streamed into storage, hashed on the way, as an object of its own under
   the checkpoint's prefix (`PREFIX/fNNNNNN`, by position: a hostile name never becomes a
   storage key), and the rows are recorded in one transaction; a failure midway deletes
   what was stored.

Nothing in the folder is unpickled, imported or parsed: only the owner's jobs open it, in their
sandboxes. Directory members are not kept (a folder checkpoint is its files).

When every file lies under one top-level folder (`tar -czf ckpt.tgz checkpoint-500`), that
folder is the checkpoint's: it is taken off the paths and names the checkpoint unless `?name=`
does. So a folder checkpoint's own tar download, uploaded again, is the same checkpoint: the
same name, the same paths, the same manifest SHA-256.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tarfile
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import anyio.to_thread

from service.checkpoints.manifest import ManifestEntry, manifest_sha256, unsafe_path_reason
from service.checkpoints.recording import record_checkpoint
from service.checkpoints.service import _key_part
from service.code.archive import ArchiveLimits as FolderLimits  # the same limits as code archives (§6)
from service.code.archive import BoundedReads, UnsafeArchive, check_member, open_archive
from service.config import Settings
from service.db import Database
from service.errors import InvalidSpec
from service.models import Checkpoint, CheckpointFile, User
from service.storage import CHUNK, Storage
from service.uploads import receive

log = logging.getLogger("torchjobs.checkpoints")
FOLDER_TYPES = frozenset(
    {"application/x-tar", "application/tar", "application/gzip", "application/x-gzip", "application/x-gtar"}
)
NOT_A_TAR = "the body is not a tar archive (plain or gzip-compressed)"


def is_folder_upload(content_type: str | None) -> bool:
    """A tar or gzip-tar body is a folder checkpoint; anything else is a file (§2, §11)."""
    return (content_type or "").split(";", 1)[0].strip().lower() in FOLDER_TYPES


@dataclass(frozen=True)
class Member:
    """A regular file of the archive: its name there, and its path in the checkpoint."""

    name: str
    path: str
    size: int


@dataclass(frozen=True)
class FolderPlan:
    top: str | None  # the one top-level folder every file was under (taken off the paths)
    members: list[Member]


@dataclass(frozen=True)
class StoredFile:
    path: str
    size_bytes: int
    sha256: str
    storage_key: str


class _GuardedFile(BoundedReads, io.FileIO):
    """A plain tar read as `service.code.archive` reads a gzip one: in bounded reads."""


@contextlib.contextmanager
def open_folder_archive(path: Path) -> Iterator[tarfile.TarFile]:
    """A gzip tar (by its magic bytes, whatever the Content-Type said) or a plain one."""
    with open(path, "rb") as fh:
        gzipped = fh.read(2) == b"\x1f\x8b"
    if gzipped:
        with open_archive(path) as tar:
            yield tar
        return
    with _GuardedFile(path, "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
        yield tar


def inspect_folder_archive(path: Path, limits: FolderLimits) -> FolderPlan:
    """Every member checked, nothing stored; raises UnsafeArchive on the first refusal."""
    found: list[Member] = []
    count = unpacked = 0
    try:
        with open_folder_archive(path) as tar:
            for member in tar:
                count += 1
                if count > limits.members:
                    raise UnsafeArchive(member.name, f"the archive has more than {limits.members} members")
                check_member(member, set())
                if member.issym():
                    raise UnsafeArchive(
                        member.name, "a symbolic link (a folder checkpoint keeps regular files only)"
                    )
                if member.isdir():
                    continue
                unpacked += member.size
                if max(unpacked, _inflated(tar.fileobj)) > limits.unpacked_bytes:
                    raise UnsafeArchive(
                        member.name, f"the archive unpacks past {limits.unpacked_bytes} bytes"
                    )
                found.append(Member(name=member.name, path=_checked_path(member.name), size=member.size))
    except UnsafeArchive:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error, ValueError, RecursionError, MemoryError) as exc:
        raise UnsafeArchive(None, f"{NOT_A_TAR} ({exc.__class__.__name__}: {exc})"[:500]) from None
    if not found:
        raise UnsafeArchive(None, "the archive holds no files")
    _check_layout(found)
    return _without_top(found)


def _checked_path(name: str) -> str:
    """The member's path in the checkpoint: `./` and repeated slashes dropped."""
    path = "/".join(p for p in name.split("/") if p not in ("", "."))
    reason = unsafe_path_reason(path)
    if reason is not None:
        raise UnsafeArchive(name, reason)
    return path


def _check_layout(members: list[Member]) -> None:
    """No path twice, and no file that another member's path goes through as a folder."""
    files = {m.path for m in members}
    if len(files) != len(members):
        seen: set[str] = set()
        for m in members:
            if m.path in seen:
                raise UnsafeArchive(m.name, "a path that is already in the archive")
            seen.add(m.path)
    for m in members:
        parts = m.path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in files:
                raise UnsafeArchive(m.name, f"a path through the file {'/'.join(parts[:i])!r}")


def _without_top(members: list[Member]) -> FolderPlan:
    firsts = {m.path.split("/", 1)[0] for m in members}
    if len(firsts) != 1 or any("/" not in m.path for m in members):
        return FolderPlan(top=None, members=members)
    top = firsts.pop()
    return FolderPlan(top=top, members=[Member(m.name, m.path.split("/", 1)[1], m.size) for m in members])


def _inflated(raw: object) -> int:
    tell = getattr(raw, "tell", None)
    try:
        return int(tell()) if tell is not None else 0
    except (OSError, ValueError):
        return 0


def store_members(storage: Storage, path: Path, plan: FolderPlan, prefix: str) -> list[StoredFile]:
    """Stream each checked file into storage, hashing it on the way. All or nothing: on any
    failure the objects stored so far are deleted before the error goes on."""
    wanted = {m.name: m for m in plan.members}
    stored: list[StoredFile] = []
    try:
        with open_folder_archive(path) as tar:
            for info in tar:
                member = wanted.get(info.name)
                if member is None or not info.isreg():
                    continue
                key = f"{prefix}/f{len(stored):06d}"
                source = tar.extractfile(info)
                if source is None:  # pragma: no cover - a regular member always has a body
                    raise UnsafeArchive(info.name, "a member without data")
                with source:
                    size, sha = storage.put_stream(_chunks(source), key)
                stored.append(StoredFile(member.path, size, sha, key))
                if size != member.size:
                    raise UnsafeArchive(info.name, f"holds {size} bytes, its header says {member.size}")
        if len(stored) != len(plan.members):
            raise UnsafeArchive(None, "the archive changed between its check and its storing")
    except BaseException:
        for f in stored:
            storage.delete(f.storage_key)
        raise
    return stored


def folder_display_name(raw: str) -> str:
    """As `clean_name` does for a file: the last path component, printable, at most 255
    characters; "upload" when nothing usable is left."""
    base = raw.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    base = "".join(ch for ch in base if ch.isprintable()).strip()[:255]
    return base if base not in ("", ".", "..") else "upload"


def _chunks(source: IO[bytes]) -> Iterator[bytes]:
    while chunk := source.read(CHUNK):
        yield chunk


async def create_folder_upload(
    db: Database,
    storage: Storage,
    settings: Settings,
    user: User,
    name: str | None,
    chunks: AsyncIterator[bytes],
) -> Checkpoint:
    """The body, checked, into a folder checkpoint of the caller's; refused bodies leave
    nothing behind (no object, no row, no temporary file)."""
    folder = settings.home / "tmp" / "uploads"
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    partial = folder / f"{token}.partial"
    try:
        await receive(chunks, partial, settings.max_upload_bytes, "checkpoint archive")
        limits = FolderLimits(unpacked_bytes=settings.max_upload_bytes, members=settings.max_code_members)
        try:
            plan = await anyio.to_thread.run_sync(inspect_folder_archive, partial, limits)
        except UnsafeArchive as exc:
            loc = ("archive", exc.member) if exc.member is not None else ("archive",)
            raise InvalidSpec(loc, str(exc), "checkpoint_refused") from None
        display = folder_display_name(name or plan.top or "upload")
        prefix = f"uploads/{user.id}/{token}-{_key_part(display)}"
        try:
            stored = await anyio.to_thread.run_sync(store_members, storage, partial, plan, prefix)
        except UnsafeArchive as exc:
            raise InvalidSpec(("archive",), str(exc), "checkpoint_refused") from None
        try:
            return await anyio.to_thread.run_sync(_record, db, user, display, prefix, stored)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_delete_all, storage, stored)
            raise
    finally:
        partial.unlink(missing_ok=True)


def _record(db: Database, user: User, name: str, prefix: str, stored: list[StoredFile]) -> Checkpoint:
    ckpt = Checkpoint(
        owner_id=user.id,
        job_id=None,
        attempt=None,
        name=name,
        epoch=None,
        step=None,
        size_bytes=sum(f.size_bytes for f in stored),
        sha256=manifest_sha256([ManifestEntry(f.path, f.size_bytes, f.sha256) for f in stored]),
        storage_key=prefix,
        metrics={},
        kind="folder",
        files=len(stored),
    )
    with db.transaction() as session:
        record_checkpoint(session, ckpt)
        session.add_all(
            CheckpointFile(
                checkpoint_id=ckpt.id,
                path=f.path,
                size_bytes=f.size_bytes,
                sha256=f.sha256,
                node_rank=0,
                storage_key=f.storage_key,
            )
            for f in stored
        )
    return ckpt


def _delete_all(storage: Storage, stored: list[StoredFile]) -> None:
    for f in stored:
        storage.delete(f.storage_key)
