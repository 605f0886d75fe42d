"""The manifest of a folder checkpoint (contract §11), and what a path in one may be.

A folder checkpoint's `sha256` is the SHA-256 of its manifest: one line `SHA256 SIZE PATH\\n`
per file, sorted by path compared as UTF-8 bytes (not as Python strings: the two orders differ
once a path holds a character past U+FFFF next to one in U+E000-U+FFFF). Whoever records a
folder and whoever serves or downloads one must build the same bytes, so both use this module.
It needs only the standard library: the client (service/client) builds the same manifest on a
laptop without the server stack (tests/test_boundaries.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class ManifestRow(Protocol):
    """Anything with a file's path, size and SHA-256: a `CheckpointFile`, a `ManifestEntry`."""

    @property
    def path(self) -> str: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def sha256(self) -> str: ...


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    size_bytes: int
    sha256: str


def path_key(path: str) -> bytes:
    """The manifest's sort key: the path's UTF-8 bytes (a stray surrogate kept, not fatal)."""
    return path.encode("utf-8", "surrogatepass")


R = TypeVar("R", bound=ManifestRow)


def sorted_rows(rows: Iterable[R]) -> list[R]:
    """The rows in manifest order."""
    return sorted(rows, key=lambda r: path_key(r.path))


def manifest_bytes(rows: Iterable[ManifestRow]) -> bytes:
    """The manifest itself, sorted here whatever order the rows come in."""
    return b"".join(
        f"{r.sha256} {int(r.size_bytes)} ".encode() + path_key(r.path) + b"\n" for r in sorted_rows(rows)
    )


def manifest_sha256(rows: Iterable[ManifestRow]) -> str:
    """The folder checkpoint's `sha256`."""
    return hashlib.sha256(manifest_bytes(rows)).hexdigest()


def manifest_of(entries: Sequence[tuple[str, int, str]]) -> tuple[bytes, str]:
    """(manifest bytes, its SHA-256) from plain (path, size, sha256) tuples."""
    data = manifest_bytes(ManifestEntry(p, s, h) for p, s, h in entries)
    return data, hashlib.sha256(data).hexdigest()


def unsafe_path_reason(path: str) -> str | None:
    """Why `path` may not name a file inside a checkpoint folder, or None when it may.

    A stored path came from a job's folder or an uploaded archive, so it is checked before it
    names a tar member or a file on a client's disk: relative, "/"-separated, no empty, `.` or
    `..` component, no NUL or other control character. A backslash is an ordinary character of
    a Linux file name and is kept, but read as a separator too (as Windows and some tar tools
    read it) it may not make the path absolute or climb with `..`.
    """
    if not path:
        return "an empty path"
    if path.startswith(("/", "\\")):
        return "an absolute path"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path):
        return "a control character in the path"
    parts = path.split("/")
    if ".." in parts or ".." in path.replace("\\", "/").split("/"):
        return "a path with a '..' component"
    if any(p in ("", ".") for p in parts):
        return "an empty or '.' path component"
    return None


def folder_name(name: str, ckpt_id: int) -> str:
    """The one path component a folder checkpoint unpacks into (its tar members' first part,
    the client's folder under `-o DIR`): its name, unless that could not be one."""
    cleaned = "".join("_" if ch in "/\\" or ord(ch) < 0x20 or ord(ch) == 0x7F else ch for ch in name)
    return cleaned if cleaned not in ("", ".", "..") else f"checkpoint-{ckpt_id}"
