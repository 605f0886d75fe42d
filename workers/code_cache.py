"""A worker's cache of unpacked code archives (contract §6), keyed by the archive's SHA-256.

Each archive is fetched and unpacked once per host, under a file lock so that nodes of two
jobs starting together wait for one unpacking, checked again member by member and unpacked
with the `data` filter (service.code.archive). Folders not used for longest are removed first
when the cache passes `TORCHJOBS_CODE_CACHE_MAX_BYTES`; a node always copies its folder at
start, so removing one later never touches a running job.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from service.code.archive import UnsafeArchive, unpack_archive
from service.code.service import limits_of
from service.config import Settings
from service.storage import Storage


class CodeUnavailable(Exception):
    """The job's code cannot be had on this host: the job fails with this reason."""


def unpacked_code(settings: Settings, storage: Storage, sha: str, storage_key: str) -> Path:
    cache = settings.cache_dir / "code"
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / sha
    if not dest.is_dir():
        with locked(cache / f".{sha}.lock"):
            if not dest.is_dir():
                _fetch_and_unpack(settings, storage, sha, storage_key, dest)
    os.utime(dest)
    prune(cache, settings.code_cache_max_bytes, keep=dest)
    return dest


def _fetch_and_unpack(settings: Settings, storage: Storage, sha: str, key: str, dest: Path) -> None:
    archive = dest.with_name(f".{sha}.{uuid.uuid4().hex}.tar.gz")
    try:
        try:
            got = storage.download_to(key, str(archive))
        except OSError as exc:
            raise CodeUnavailable(f"could not fetch code {sha[:12]}: {exc.__class__.__name__}") from exc
        if got != sha:
            raise CodeUnavailable(f"code {sha[:12]} failed its SHA-256 check")
        try:
            unpack_archive(archive, dest, limits_of(settings))
        except UnsafeArchive as exc:
            raise CodeUnavailable(f"code {sha[:12]} refused: {exc}") from exc
    finally:
        archive.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One unpacking per archive per host, across the worker's threads and processes."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # gone meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def prune(cache: Path, max_bytes: int, keep: Path) -> None:
    """Least recently used folders go first, until the cache fits (the one in use stays; names
    starting with "." are work in progress). Both the code and the environment caches use it:
    a node copies its code and its ranks import their packages at start, so a folder removed
    later is rebuilt by the next node that needs it, never pulled from under a running one."""
    folders = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".") and p != keep]
    sizes = {p: folder_bytes(p) for p in folders}
    total = sum(sizes.values()) + folder_bytes(keep)
    for folder in sorted(folders, key=lambda p: p.stat().st_mtime):
        if total <= max_bytes:
            break
        total -= sizes[folder]
        shutil.rmtree(folder, ignore_errors=True)
