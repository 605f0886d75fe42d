"""Checkpoint storage behind `TORCHJOBS_STORAGE_URL`, on fsspec (`file://`, `s3://`, ...).

Keys are relative paths under the storage root. A reader never sees half a checkpoint: on a
local (or shared) filesystem a write goes to a temporary name in the same folder and is renamed
into place once complete; on an object store an object only appears once its upload completes.
Options for the filesystem (an S3 endpoint, credentials profile, ...) come from
`TORCHJOBS_STORAGE_OPTIONS` as JSON.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

import fsspec

if TYPE_CHECKING:
    from service.config import Settings

CHUNK = 1024 * 1024
REMOTE_BLOCK = 8 * CHUNK  # read-ahead of one remote reader: the memory one download may hold


class Storage:
    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.root = root.rstrip("/")
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        self.is_local = "file" in protocols or "local" in protocols
        if self.is_local:
            self.fs.makedirs(self.root, exist_ok=True)

    @classmethod
    def from_settings(cls, settings: Settings) -> Storage:
        return cls(settings.resolved_storage_url, **settings.storage_options)

    def path(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad storage key {key!r}")
        return f"{self.root}/{key}"

    def local_path(self, key: str) -> str | None:
        """The key's path on this machine's filesystem, when storage is local; else None."""
        return self.path(key) if self.is_local else None

    # -- writing -------------------------------------------------------------------------

    def put_stream(self, chunks: Iterator[bytes], key: str, max_bytes: int | None = None) -> tuple[int, str]:
        """Stream chunks into `key`; returns (size, sha256). Raises OverflowError past max_bytes.

        On an object store the chunks are spooled to a local temporary file first: fsspec's
        writers commit whatever they hold when closed, even after an error, and a half object
        under its final key is exactly what must never exist.
        """
        if not self.is_local:
            with tempfile.NamedTemporaryFile(prefix="torchjobs-", suffix=".partial") as spool:
                size, sha = _copy_hashing(chunks, spool, max_bytes)
                spool.flush()
                self.put_local_copy(spool.name, key, size)
            return size, sha
        target = self.path(key)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = self._staging_path(target)
        try:
            with open(tmp, "wb") as out:
                size, sha = _copy_hashing(chunks, out, max_bytes)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
        except BaseException:
            self._remove_quietly(tmp)
            raise
        return size, sha

    def put_file(self, local_path: str, key: str) -> tuple[int, str]:
        """Copy a local file into `key`; returns (size, sha256) of what was stored."""
        if not self.is_local:
            size, sha = file_sha256(local_path)
            self.put_local_copy(local_path, key, size)
            return size, sha
        with open(local_path, "rb") as fh:
            return self.put_stream(iter(lambda: fh.read(CHUNK), b""), key)

    def put_local_copy(self, local_path: str, key: str, size: int) -> None:
        """Upload a local file to an object store under `key` and check the stored size."""
        target = self.path(key)
        try:
            self.fs.put_file(local_path, target)
            stored = self.size(key)
        except BaseException:
            self._remove_quietly(target)
            raise
        if stored != size:
            self._remove_quietly(target)
            raise OSError(f"storage kept {stored} bytes of {size} for {key}")

    def put_local(self, local_path: str, key: str) -> None:
        """Move a complete local file (already hashed by the caller) into `key`.

        On local storage on the same filesystem this is a rename, so a 1 GiB upload is not
        copied again; elsewhere it is a copy (local) or an upload (object store).
        """
        target = self.path(key)
        if not self.is_local:
            self.put_local_copy(local_path, key, os.path.getsize(local_path))
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.replace(local_path, target)
            return
        except OSError:
            pass  # another filesystem: copy to a staging name beside the target, then rename
        tmp = self._staging_path(target)
        try:
            shutil.copyfile(local_path, tmp)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            self._remove_quietly(tmp)
            raise

    # -- reading -------------------------------------------------------------------------

    def open(self, key: str) -> IO[bytes]:
        if self.is_local:
            return open(self.path(key), "rb")  # the caller closes it
        return self.fs.open(self.path(key), "rb", block_size=REMOTE_BLOCK, cache_type="readahead")

    def size(self, key: str) -> int:
        return int(self.fs.size(self.path(key)))

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.path(key)))

    def list(self, prefix: str = "") -> list[str]:
        """Every key under `prefix` (recursively), relative to the root."""
        base = self.root if not prefix else self.path(prefix.rstrip("/"))
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(p[len(self.root) + 1 :] for p in found if p.startswith(self.root + "/"))

    def delete(self, key: str) -> None:
        self._remove_quietly(self.path(key))

    def download_to(self, key: str, local_path: str) -> str:
        """Copy to a local file and return its sha256."""
        digest = hashlib.sha256()
        with self.open(key) as src, open(local_path, "wb") as dst:
            for chunk in iter(lambda: src.read(CHUNK), b""):
                digest.update(chunk)
                dst.write(chunk)
        return digest.hexdigest()

    def _staging_path(self, target: str) -> str:
        """Where a write goes first: beside the target on a filesystem, the target itself on an
        object store (an object appears only once its upload completes)."""
        if not self.is_local:
            return target
        folder, name = target.rsplit("/", 1)
        return f"{folder}/.{name}.{uuid.uuid4().hex}.partial"

    def _remove_quietly(self, path: str) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path)
        except OSError:
            pass


def _copy_hashing(chunks: Iterator[bytes], out: IO[bytes], max_bytes: int | None) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    for chunk in chunks:
        size += len(chunk)
        if max_bytes is not None and size > max_bytes:
            raise OverflowError(size)
        digest.update(chunk)
        out.write(chunk)
    return size, digest.hexdigest()


def file_sha256(path: str) -> tuple[int, str]:
    """(size, sha256) of a local file, read in 1 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            size += len(chunk)
            digest.update(chunk)
    return size, digest.hexdigest()
