"""Checkpoint storage behind `TORCHJOBS_STORAGE_URL`, on fsspec (`file://`, `s3://`, ...).

Keys are relative paths under the storage root. Writes go to a temporary key and are moved
into place only once complete, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from typing import IO, Any

import fsspec

CHUNK = 1024 * 1024


class Storage:
    def __init__(self, url: str, **options: Any) -> None:
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.root = root.rstrip("/")
        if self.fs.protocol in ("file", ("file", "local")) or "file" in self.fs.protocol:
            self.fs.makedirs(self.root, exist_ok=True)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def put_stream(self, chunks: Iterator[bytes], key: str, max_bytes: int | None = None) -> tuple[int, str]:
        """Stream chunks into `key`; returns (size, sha256). Raises OverflowError past max_bytes."""
        tmp = self.path(f"tmp/{uuid.uuid4().hex}.partial")
        self.fs.makedirs(self.path("tmp"), exist_ok=True)
        digest, size = hashlib.sha256(), 0
        try:
            with self.fs.open(tmp, "wb") as out:
                for chunk in chunks:
                    size += len(chunk)
                    if max_bytes is not None and size > max_bytes:
                        raise OverflowError(size)
                    digest.update(chunk)
                    out.write(chunk)
            parent = self.path(key).rsplit("/", 1)[0]
            self.fs.makedirs(parent, exist_ok=True)
            self.fs.mv(tmp, self.path(key))
        except BaseException:
            self._remove_quietly(tmp)
            raise
        return size, digest.hexdigest()

    def put_file(self, local_path: str, key: str) -> tuple[int, str]:
        with open(local_path, "rb") as fh:
            return self.put_stream(iter(lambda: fh.read(CHUNK), b""), key)

    def open(self, key: str) -> IO[bytes]:
        return self.fs.open(self.path(key), "rb")

    def size(self, key: str) -> int:
        return int(self.fs.size(self.path(key)))

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.path(key)))

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

    def _remove_quietly(self, path: str) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path)
        except OSError:
            pass
