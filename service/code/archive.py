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

import os
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

NOT_A_TAR = "the body is not a gzip-compressed tar archive"


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


def inspect_archive(path: Path, limits: ArchiveLimits) -> ArchiveSummary:
    """Every member checked, nothing extracted; raises UnsafeArchive on the first refusal."""
    files = unpacked = members = 0
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            raw = tar.fileobj
            for member in tar:
                members += 1
                if members > limits.members:
                    raise UnsafeArchive(member.name, f"the archive has more than {limits.members} members")
                check_member(member)
                if member.isreg():
                    files += 1
                    unpacked += member.size
                _check_size(member.name, max(unpacked, _inflated(raw)), limits)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise UnsafeArchive(None, f"{NOT_A_TAR} ({exc.__class__.__name__}: {exc})") from None
    if members == 0:
        raise UnsafeArchive(None, "the archive is empty")
    return ArchiveSummary(files=files, unpacked_bytes=unpacked)


def check_member(member: tarfile.TarInfo) -> None:
    name = member.name
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or (parts and ":" in parts[0]):
        raise UnsafeArchive(name, "an absolute path")
    if ".." in parts or ".." in PurePosixPath(name.replace("\\", "/")).parts:
        raise UnsafeArchive(name, "a path with a '..' component")
    if member.issym():
        _check_link_target(member)
    elif member.islnk():
        raise UnsafeArchive(name, "a hard link")
    elif member.ischr() or member.isblk():
        raise UnsafeArchive(name, "a device")
    elif member.isfifo():
        raise UnsafeArchive(name, "a fifo")
    elif not (member.isreg() or member.isdir()):
        raise UnsafeArchive(name, f"a special member (tar type {member.type!r})")


def _check_link_target(member: tarfile.TarInfo) -> None:
    target = member.linkname
    if target.startswith("/") or not target:
        raise UnsafeArchive(member.name, f"a link to {target!r}, outside the archive")
    resolved = os.path.normpath(os.path.join(os.path.dirname(member.name), target))
    if resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
        raise UnsafeArchive(member.name, f"a link to {target!r}, outside the archive")


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
        with tarfile.open(archive, mode="r:gz") as tar:
            tar.extractall(staging, filter="data")
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return summary
