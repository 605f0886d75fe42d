"""A checkpoint to resume from, on the node (contract §11): staged from storage, cached per host
by checkpoint id, and copied into the checkpoint folder for frameworks that resume by themselves.

A folder checkpoint is fetched file by file into a hidden folder of the cache, each file's
SHA-256 checked on the way, then renamed into place whole: a node never sees half of one, and
the next attempt on this host (a retry, a preemption) fetches nothing. The staged folder is
read-only for the ranks (bound read-only in a sandbox; its modes elsewhere).

The writable copy in `TORCHJOBS_CHECKPOINT_DIR` comes from the worker's own staged copy, never
from a job's folder, and belongs to the node's user.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from workers.launcher.jobfiles import remove_tree

StoredFile = tuple[str, int, str, str]  # path, size, sha256, storage key
FOLDER_MIN_IDLE_S = 3600.0  # a staged folder used this recently is never pruned


class Fetcher(Protocol):
    def download_to(self, key: str, local_path: str) -> str: ...


class StagingFailed(Exception):
    """A file could not be fetched, or failed its SHA-256 check."""


def placeable(name: str) -> bool:
    """A name that can be one entry of the checkpoint folder (an upload's may be anything)."""
    return bool(name) and "/" not in name and "\0" not in name and not name.startswith(".")


def stage_folder(storage: Fetcher, cache: Path, ckpt_id: int, name: str, files: Sequence[StoredFile]) -> Path:
    """The folder checkpoint at `cache/folder-ID/NAME` (fetched once per host), read-only."""
    home = cache / f"folder-{ckpt_id}"
    target = home / (name if placeable(name) else f"checkpoint-{ckpt_id}")
    if target.is_dir():
        os.utime(home)
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".folder-{ckpt_id}.{uuid.uuid4().hex}.partial"
    try:
        inner = partial / target.name
        for path, _size, sha, key in files:
            local = inner / path
            if not _safe(path):
                raise StagingFailed(f"checkpoint {ckpt_id}: a stored path that leaves its folder: {path!r}")
            local.parent.mkdir(parents=True, exist_ok=True)
            if storage.download_to(key, str(local)) != sha:
                raise StagingFailed(f"checkpoint {ckpt_id}: {path} failed its SHA-256 check")
        inner.mkdir(parents=True, exist_ok=True)
        _read_only(partial)
        try:
            os.rename(partial, home)
        except OSError:  # another node of this host staged it meanwhile
            if not target.is_dir():
                raise
    finally:
        if partial.exists():
            _writable(partial)
            remove_tree(partial)
    return target


def prune_folders(cache: Path, max_bytes: int, keep: Path, min_idle_s: float = FOLDER_MIN_IDLE_S) -> None:
    """The host's staged folders, least recently used first, until the checkpoint cache (its
    files too) fits `max_bytes`. The one in use stays, and so does one staged or used within
    `min_idle_s` (a running node may be reading it: the cap is a soft one while many are
    busy). Each goes renamed away first, so no node ever finds one half gone."""
    now = time.time()
    staged: list[tuple[float, Path]] = []
    for path in cache.glob("folder-*"):
        if path != keep and path.is_dir():
            with contextlib.suppress(FileNotFoundError):  # removed by another node meanwhile
                staged.append((path.stat().st_mtime, path))
    sizes = {p: _tree_bytes(p) for _, p in staged}
    total = sum(sizes.values()) + _tree_bytes(keep) + sum(_size(p) for p in cache.glob("*.pt"))
    for used, folder in sorted(staged):
        if total <= max_bytes or now - used < min_idle_s:
            break
        victim = cache / f".{folder.name}.removing-{uuid.uuid4().hex}"
        try:
            folder.rename(victim)
        except OSError:
            continue
        total -= sizes[folder]
        _writable(victim)
        remove_tree(victim)


def _tree_bytes(root: Path) -> int:
    total = 0
    for folder, _dirs, names in os.walk(root):
        total += sum(_size(Path(folder) / name) for name in names)
    return total


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _safe(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and not any(p in ("", ".", "..") for p in parts)


def _read_only(root: Path) -> None:
    for folder, _dirs, names in os.walk(root):
        for name in names:
            os.chmod(os.path.join(folder, name), 0o444)
        os.chmod(folder, 0o555)


def _writable(root: Path) -> None:
    for folder, _dirs, _names in os.walk(root):
        os.chmod(folder, 0o755)


def place_copy(source: Path, checkpoints: Path, name: str, owner: tuple[int, int] | None) -> bool:
    """`source` (the worker's staged checkpoint) copied, writable, as `checkpoints/name`
    before the ranks start; False where the name cannot be an entry there."""
    if not placeable(name):
        return False
    dest = checkpoints / name
    if os.path.lexists(dest):  # placed already (a spare sandbox's hand-over that was retried)
        return True
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=False)
        for folder, _dirs, files in os.walk(dest):
            os.chmod(folder, 0o755)
            for entry in files:
                os.chmod(os.path.join(folder, entry), 0o644)
    else:
        shutil.copyfile(source, dest)
        os.chmod(dest, 0o644)
    if owner is not None:
        os.chown(dest, *owner)
        for folder, dirs, files in os.walk(dest) if dest.is_dir() else ():
            for entry in (*dirs, *files):
                os.chown(os.path.join(folder, entry), *owner, follow_symlinks=False)
    return True
