"""Checkpoint logic: reading what is yours, ranged downloads, safe uploads, retention.

Reads inside a request take the caller's session and raise domain errors. The two streaming
paths (download and upload) take no request session at all: a transaction held open while a
gigabyte moves would hold a connection — and on SQLite the write lock — for minutes. They read
and write in short transactions of their own, and do the slow work outside any.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import format_datetime

import anyio
import anyio.to_thread
from sqlalchemy.orm import Session

from service.checkpoints import repository as repo
from service.checkpoints.recording import record_checkpoint
from service.checkpoints.upload_check import UploadRefused, check_upload
from service.config import Settings
from service.db import Database
from service.errors import Conflict, InvalidSpec, NotFound, RangeNotSatisfiable
from service.models import Checkpoint, Job, User
from service.schemas import CheckpointOut, checkpoint_out
from service.storage import CHUNK, Storage
from service.uploads import receive

log = logging.getLogger("torchjobs.checkpoints")
_UNSAFE_KEY_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


# -- reading -------------------------------------------------------------------------------


def get_checkpoint(session: Session, user: User, ckpt_id: int) -> Checkpoint:
    """The checkpoint, if it is the caller's (the admin sees all); another user's is a 404."""
    ckpt = repo.get(session, ckpt_id, None if user.is_admin else user.id)
    if ckpt is None:
        raise NotFound("checkpoint")
    return ckpt


def list_checkpoints(session: Session, job: Job) -> list[CheckpointOut]:
    """A job's checkpoints, oldest first; `job` has already been checked to be the caller's."""
    return [checkpoint_out(c) for c in repo.list_for_job(session, job.id)]


# -- downloads -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DownloadPlan:
    status: int  # 200 the whole file, 206 one range, 304 not modified
    start: int
    end: int  # exclusive
    headers: dict[str, str]

    @property
    def length(self) -> int:
        return self.end - self.start


def etag_of(ckpt: Checkpoint) -> str:
    return f'"{ckpt.sha256}"'


async def check_stored(storage: Storage, ckpt_id: int, key: str, size: int, what: str) -> None:
    """The stored object is there (else 404) and still the recorded size (else 409, `what`
    naming the checkpoint or its file): a download never streams bytes it cannot vouch for."""
    try:
        stored = await anyio.to_thread.run_sync(storage.size, key)
    except FileNotFoundError:
        log.error("checkpoint %s: %s is missing from storage", ckpt_id, key)
        raise NotFound("checkpoint data") from None
    if stored != size:
        log.error("checkpoint %s: %s holds %s bytes, recorded %s", ckpt_id, key, stored, size)
        raise Conflict(f"the stored {what} no longer matches its record")


async def plan_download(
    storage: Storage,
    ckpt: Checkpoint,
    *,
    range_header: str | None,
    if_range: str | None,
    if_none_match: str | None,
) -> DownloadPlan:
    """What to send for a GET: checks the stored object, then honours Range and If-Range.

    Raises RangeNotSatisfiable (416) for a range that starts past the end, NotFound when the
    stored bytes are gone, Conflict when they no longer match the record.
    """
    await check_stored(storage, ckpt.id, ckpt.storage_key, ckpt.size_bytes, "checkpoint")
    return plan_bytes(
        size=ckpt.size_bytes,
        sha256=ckpt.sha256,
        modified=ckpt.created_at,
        filename=ckpt.name,
        range_header=range_header,
        if_range=if_range,
        if_none_match=if_none_match,
    )


def plan_bytes(
    *,
    size: int,
    sha256: str,
    modified: datetime,
    filename: str,
    range_header: str | None,
    if_range: str | None,
    if_none_match: str | None,
) -> DownloadPlan:
    """`plan_download` for any body whose size and SHA-256 are known in advance: a stored file,
    one file of a folder checkpoint, a folder's tar (contract §11). The ETag is the SHA-256."""
    etag = f'"{sha256}"'
    last_modified = _http_date(modified)
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "X-Checksum-SHA256": sha256,
        "Last-Modified": last_modified,
        "Cache-Control": "private, no-transform",
        "Content-Disposition": _attachment(filename),
    }
    if if_none_match is not None and _etag_listed(if_none_match, etag):
        return DownloadPlan(status=304, start=0, end=0, headers=headers)
    wanted = parse_range(range_header, size)
    if wanted is not None and if_range is not None and if_range.strip() not in (etag, last_modified):
        wanted = None  # the client's partial copy is of another file: send this one whole
    if wanted is None:
        return DownloadPlan(status=200, start=0, end=size, headers={**headers, "Content-Length": str(size)})
    start, end = wanted
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    headers["Content-Length"] = str(end - start)
    return DownloadPlan(status=206, start=start, end=end, headers=headers)


class UnsatisfiableRange(RangeNotSatisfiable):
    """A 416 that knows the size, for its `Content-Range: bytes */SIZE` header."""

    def __init__(self, size: int) -> None:
        super().__init__(f"range not satisfiable: the file has {size} bytes")
        self.size = size


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """One `bytes=` range as [start, end), or None to send the whole file.

    Per RFC 9110 a header we cannot use (another unit, bad syntax, several ranges) is ignored;
    a well-formed range that starts at or past the end is a 416.
    """
    if header is None:
        return None
    unit, sep, spec = header.strip().partition("=")
    if not sep or unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    first, last = first.strip(), last.strip()
    if not dash or not (_byte_pos(first) and _byte_pos(last)):
        return None
    if first == "":
        if last == "":
            return None
        suffix = int(last)
        if suffix == 0 or size == 0:
            raise UnsatisfiableRange(size)
        return max(size - suffix, 0), size
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise UnsatisfiableRange(size)
    end = size if not last else min(int(last) + 1, size)
    return start, end


def _byte_pos(text: str) -> bool:
    """Empty, or ASCII digits short enough to be a real position (never '³', never 5000 digits)."""
    return text == "" or (text.isascii() and text.isdigit() and len(text) <= 19)


async def read_range(storage: Storage, key: str, start: int, end: int) -> AsyncIterator[bytes]:
    """Bytes [start, end) of a stored object in 1 MiB chunks, each read in a worker thread:
    memory stays at one chunk per download whatever the file's size."""
    fh = await anyio.to_thread.run_sync(storage.open, key)
    try:
        if start:
            await anyio.to_thread.run_sync(fh.seek, start)
        remaining = end - start
        while remaining > 0:
            chunk = await anyio.to_thread.run_sync(fh.read, min(CHUNK, remaining))
            if not chunk:
                raise OSError(f"{key} ended {remaining} bytes early")
            remaining -= len(chunk)
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(fh.close)


def _http_date(when: datetime) -> str:
    utc = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    return format_datetime(utc, usegmt=True)


def _etag_listed(header: str, etag: str) -> bool:
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


def _attachment(name: str) -> str:
    from urllib.parse import quote

    ascii_name = name.encode("ascii", "replace").decode().replace('"', "_").replace("\\", "_")
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name, safe='')}"


# -- uploads -------------------------------------------------------------------------------


def clean_name(name: str) -> str:
    """The display name of an upload: its last path component, printable, at most 255 chars."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(ch for ch in base if ch.isprintable()).strip()
    return base[:255] if base not in ("", ".", "..") else "upload.pt"


async def create_upload(
    db: Database,
    storage: Storage,
    settings: Settings,
    user: User,
    name: str,
    chunks: AsyncIterator[bytes],
) -> Checkpoint:
    """A user's own file: received to a local temporary file in constant memory, validated in a
    subprocess, then put into storage and recorded. Refused files leave nothing behind."""
    name = clean_name(name)
    folder = settings.home / "tmp" / "uploads"
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    partial = folder / f"{token}.partial"
    try:
        size, sha = await receive(chunks, partial, settings.max_upload_bytes)
        if size == 0:
            raise InvalidSpec((), "the upload is empty")
        try:
            info = await anyio.to_thread.run_sync(
                check_upload,
                str(partial),
                name,
                settings.upload_validate_timeout_s,
                limiter=_validation_slots(),
            )
        except UploadRefused as exc:
            raise InvalidSpec((), str(exc), "checkpoint_refused") from None
        key = f"uploads/{user.id}/{token}-{_key_part(name)}"
        await anyio.to_thread.run_sync(storage.put_local, str(partial), key)
        ckpt = Checkpoint(
            owner_id=user.id,
            job_id=None,
            attempt=None,
            name=name,
            epoch=info.epoch,
            step=info.step,
            size_bytes=size,
            sha256=sha,
            storage_key=key,
            metrics={},
        )
        try:
            return await anyio.to_thread.run_sync(_record, db, ckpt)
        except BaseException:
            await anyio.to_thread.run_sync(storage.delete, key)
            raise
    finally:
        partial.unlink(missing_ok=True)


_slots: dict[str, anyio.CapacityLimiter] = {}


def _validation_slots() -> anyio.CapacityLimiter:
    """At most two validation subprocesses at once per server (each loads a whole file), in
    threads of their own, so that uploads never starve the threads the other routes run in."""
    if "validate" not in _slots:
        _slots["validate"] = anyio.CapacityLimiter(2)
    return _slots["validate"]


def _record(db: Database, ckpt: Checkpoint) -> Checkpoint:
    with db.transaction() as session:
        return record_checkpoint(session, ckpt)


def _key_part(name: str) -> str:
    return _UNSAFE_KEY_CHARS.sub("_", name)[-100:].lstrip(".") or "checkpoint"
