"""What a code archive may hold, checked before anything of it is kept or unpacked.

The API server reads every member header of an uploaded `.tar.gz` once, without extracting
anything, and refuses the whole archive on the first member that could write outside its
folder or is not plain data: an absolute path, a `..` component, a symbolic link that points
outside the archive, a hard link, a device, a fifo, or any other special member. The sizes in
the headers and the bytes actually inflated are both counted, so a gzip bomb is stopped at the
limit, not after it. Workers check again with the same function before they unpack, and unpack
with `tarfile`'s `data` filter (PEP 706) as a second wall.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

NOT_A_TAR = "the body is not a gzip-compressed tar archive"
MAX_READ = 16 * 1024**2  # no single read larger: a header claiming gigabytes is refused, not allocated


@dataclass(frozen=True)
class ArchiveLimits:
    unpacked_bytes: int
    members: int


@dataclass(frozen=True)
class ArchiveSummary:
    files: int
    unpacked_bytes: int


class UnsafeArchive(Exception):
    """The archive is refused; `member` names the first offending member (None: the archive)."""

    def __init__(self, member: str | None, reason: str) -> None:
        super().__init__(f"{member}: {reason}" if member is not None else reason)
        self.member, self.reason = member, reason


class BoundedReads:
    """Refuses any one read past MAX_READ, whole-stream reads included. tarfile reads a pax or
    long-name header whole, at the size the header itself claims; file data it reads (or skips)
    in small blocks. Mixed into the stream a tar is read from (before the stream's class)."""

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0 or size > MAX_READ:
            raise UnsafeArchive(None, f"a member header claims more than {MAX_READ} bytes")
        return super().read(size)  # type: ignore[misc]  # the stream class mixed in after this one


class _Inflating(BoundedReads, gzip.GzipFile):
    """The decompressed stream of a gzip tar, in bounded reads."""


@contextlib.contextmanager
def open_archive(path: Path) -> Iterator[tarfile.TarFile]:
    with _Inflating(path, "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
        yield tar


def inspect_archive(path: Path, limits: ArchiveLimits) -> ArchiveSummary:
    """Every member checked, nothing extracted; raises UnsafeArchive on the first refusal."""
    files = unpacked = members = 0
    links: set[str] = set()
    try:
        with open_archive(path) as tar:
            for member in tar:
                members += 1
                if members > limits.members:
                    raise UnsafeArchive(member.name, f"the archive has more than {limits.members} members")
                check_member(member, links)
                if member.isreg():
                    files += 1
                    unpacked += member.size
                _check_size(member.name, max(unpacked, _inflated(tar.fileobj)), limits)
    except UnsafeArchive:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error, ValueError, RecursionError, MemoryError) as exc:
        raise UnsafeArchive(None, f"{NOT_A_TAR} ({exc.__class__.__name__}: {exc})"[:500]) from None
    if members == 0:
        raise UnsafeArchive(None, "the archive is empty")
    return ArchiveSummary(files=files, unpacked_bytes=unpacked)


def check_member(member: tarfile.TarInfo, links: set[str]) -> None:
    """`links`: the archive's symbolic links so far; a path through one is refused (on disk it
    could lead anywhere the link does), and this member is added when it is one."""
    name = member.name
    if name.startswith(("/", "\\")):
        raise UnsafeArchive(name, "an absolute path")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if ".." in parts:
        raise UnsafeArchive(name, "a path with a '..' component")
    _walk(name, list(parts), links)
    if member.issym():
        _check_link_target(member, links)
        links.add(_normal(parts))
    elif member.islnk():
        raise UnsafeArchive(name, "a hard link")
    elif member.ischr() or member.isblk():
        raise UnsafeArchive(name, "a device")
    elif member.isfifo():
        raise UnsafeArchive(name, "a fifo")
    elif not (member.isreg() or member.isdir()):
        raise UnsafeArchive(name, f"a special member (tar type {member.type!r})")


def _check_link_target(member: tarfile.TarInfo, links: set[str]) -> None:
    target = member.linkname
    if not target or target.startswith("/"):
        raise UnsafeArchive(member.name, f"a link to {target!r}, outside the archive")
    parent = list(PurePosixPath(member.name).parts[:-1])
    _walk(member.name, parent + list(PurePosixPath(target).parts), links, target=target)


def _walk(name: str, parts: list[str], links: set[str], target: str | None = None) -> None:
    """Follow `parts` from the archive's root: never above it, never through a link."""
    here: list[str] = []
    for i, part in enumerate(parts):
        if part in ("", "."):
            continue
        if part == "..":
            if not here:
                raise UnsafeArchive(name, f"a link to {target!r}, outside the archive")
            here.pop()
            continue
        here.append(part)
        last = i == len(parts) - 1  # the member itself, or a link's final target, may be a (checked) link
        if not last and _normal(here) in links:
            raise UnsafeArchive(name, f"a path through the link {_normal(here)!r}")


def _normal(parts: Iterable[str]) -> str:
    return "/".join(p for p in parts if p not in ("", "."))


def _inflated(raw: object) -> int:
    """How far into the inflated stream tarfile has read (it skips file data by reading it)."""
    tell = getattr(raw, "tell", None)
    try:
        return int(tell()) if tell is not None else 0
    except (OSError, ValueError):
        return 0


def _check_size(name: str, unpacked: int, limits: ArchiveLimits) -> None:
    if unpacked > limits.unpacked_bytes:
        raise UnsafeArchive(name, f"the archive unpacks past {limits.unpacked_bytes} bytes")


def unpack_archive(archive: Path, dest: Path, limits: ArchiveLimits) -> ArchiveSummary:
    """Check, then extract into `dest` (made here, atomically: a half-unpacked folder is never
    left under its final name)."""
    summary = inspect_archive(archive, limits)
    staging = dest.with_name(f".{dest.name}.unpacking-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with open_archive(archive) as tar:
            tar.extractall(staging, filter="data")
        staging.rename(dest)
    except (tarfile.TarError, OSError) as exc:  # what the data filter refuses, or the disk
        shutil.rmtree(staging, ignore_errors=True)
        raise UnsafeArchive(None, f"cannot be unpacked here: {exc}"[:500]) from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return summary
