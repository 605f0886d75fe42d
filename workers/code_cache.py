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
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from service.config import Settings
from service.nodes.code import UnsafeArchive, limits_of, unpack_archive
from service.storage import Storage

MIN_IDLE_S = 3600.0  # a cached folder used this recently is never pruned


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
    with contextlib.suppress(FileNotFoundError):
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


def prune(cache: Path, max_bytes: int, keep: Path, min_idle_s: float = MIN_IDLE_S) -> None:
    """Least recently used folders go first, until the cache fits. Both the code and the
    environment caches use it. The one in use stays, and so does any folder used within
    `min_idle_s`: a running node may still import from its environment (the cap is a soft one
    while many are busy). A folder is renamed away before it is removed, so no reader ever
    finds it half gone; names starting with "." are work in progress."""
    now = time.time()
    folders: list[tuple[float, Path]] = []
    for path in cache.iterdir():
        if path.name.startswith(".") or path == keep or not path.is_dir():
            continue
        with contextlib.suppress(FileNotFoundError):  # removed by another node meanwhile
            folders.append((path.stat().st_mtime, path))
    sizes = {p: folder_bytes(p) for _, p in folders}
    total = sum(sizes.values()) + folder_bytes(keep)
    for used, folder in sorted(folders):
        if total <= max_bytes or now - used < min_idle_s:
            break
        victim = folder.with_name(f".{folder.name}.removing-{uuid.uuid4().hex}")
        try:
            folder.rename(victim)
        except OSError:
            continue
        total -= sizes[folder]
        shutil.rmtree(victim, ignore_errors=True)


def sweep_staging(cache: Path, max_age_s: float = 86_400.0) -> None:
    """What a killed worker left behind: staging folders of dead processes, folders half
    removed, partial downloads older than a day. Called at worker start."""
    if not cache.is_dir():
        return
    now = time.time()
    for path in cache.iterdir():
        name = path.name
        if not name.startswith("."):
            continue
        pid = name.rsplit("-", 1)[-1]
        dead = (".building-" in name or ".unpacking-" in name) and pid.isdigit() and not _alive(int(pid))
        with contextlib.suppress(FileNotFoundError):
            old = now - path.stat().st_mtime > max_age_s and not name.endswith(".lock")
            if dead or ".removing-" in name or old:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
