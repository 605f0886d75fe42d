"""Code archives behind the API: upload (checked, content-addressed), read, list.

An upload takes no request session: the body is received to a local file and checked member by
member (`archive.inspect_archive`) outside any transaction; only then are its bytes stored,
under their SHA-256, and the row recorded in a short transaction. A refused archive leaves
nothing behind: not in the storage, not in the database, not on disk.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio.to_thread
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.code import repository as repo
from service.code.archive import ArchiveLimits, UnsafeArchive, inspect_archive
from service.code.schemas import CodeList, CodeOut
from service.config import Settings
from service.db import Database
from service.errors import InvalidSpec, NotFound
from service.models import CodeArchive, User
from service.storage import Storage
from service.uploads import receive


def limits_of(settings: Settings) -> ArchiveLimits:
    return ArchiveLimits(unpacked_bytes=settings.max_code_unpacked_bytes, members=settings.max_code_members)


def storage_key(sha256: str) -> str:
    return f"code/{sha256}.tar.gz"


async def upload_code(
    db: Database, storage: Storage, settings: Settings, user: User, name: str, chunks: AsyncIterator[bytes]
) -> tuple[CodeOut, bool]:
    """(the Code, created). The same bytes from the same user again: the same Code."""
    folder = settings.home / "tmp" / "code"
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{uuid.uuid4().hex}.partial"
    try:
        size, sha = await receive(chunks, partial, settings.max_code_bytes, "code archive")
        existing = await anyio.to_thread.run_sync(_read_owned, db, user, sha)
        if existing is not None:
            return existing, False
        try:
            summary = await anyio.to_thread.run_sync(inspect_archive, partial, limits_of(settings))
        except UnsafeArchive as exc:
            loc = ("archive", exc.member) if exc.member is not None else ("archive",)
            raise InvalidSpec(loc, str(exc), "code_refused") from None
        key = storage_key(sha)
        if not await anyio.to_thread.run_sync(storage.exists, key):
            await anyio.to_thread.run_sync(storage.put_local, str(partial), key)
        row = CodeArchive(
            owner_id=user.id,
            sha256=sha,
            name=name,
            size_bytes=size,
            unpacked_bytes=summary.unpacked_bytes,
            files=summary.files,
            storage_key=key,
        )
        return await anyio.to_thread.run_sync(_record, db, user, row)
    finally:
        partial.unlink(missing_ok=True)


def _read_owned(db: Database, user: User, sha: str) -> CodeOut | None:
    with db.read() as session:
        row = repo.owned(session, user.id, sha)
        return code_out(row, user.name) if row is not None else None


def _record(db: Database, user: User, row: CodeArchive) -> tuple[CodeOut, bool]:
    try:
        with db.transaction() as session:
            repo.add(session, row)
            return code_out(row, user.name), True
    except IntegrityError:  # the same user sent the same bytes twice at once: one row wins
        existing = _read_owned(db, user, row.sha256)
        if existing is None:
            raise
        return existing, False


def get_code(session: Session, user: User, code_id: str) -> CodeOut:
    """The caller's own Code (the admin sees any uploader's); anyone else's is a 404."""
    row = usable_code(session, user, code_id)
    if row is None:
        raise NotFound("code")
    names = repo.owner_names(session, {row.owner_id})
    return code_out(row, names.get(row.owner_id, ""))


def list_code(session: Session, user: User) -> CodeList:
    return CodeList(items=[code_out(r, user.name) for r in repo.list_owned(session, user.id)])


def code_out(row: CodeArchive, owner: str) -> CodeOut:
    return CodeOut(
        id=row.sha256,
        name=row.name,
        owner=owner,
        size_bytes=row.size_bytes,
        unpacked_bytes=row.unpacked_bytes,
        files=row.files,
        created_at=row.created_at,
    )


def usable_code(session: Session, user: User, code_id: str) -> CodeArchive | None:
    """What a job spec's `code` may name: the submitter's own upload (the admin's: any)."""
    row = repo.owned(session, user.id, code_id)
    if row is None and user.is_admin:
        row = repo.any_with(session, code_id)
    return row


def default_name(name: str | None) -> str:
    cleaned = "".join(ch for ch in (name or "") if ch.isprintable()).strip()
    return cleaned[:255] or "code"


def local_archive(settings: Settings, sha: str) -> Path:
    return settings.cache_dir / "code" / f"{sha}.tar.gz"
