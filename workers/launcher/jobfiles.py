"""The worker's only way into a job's folders: files opened as data, never followed (contract §7 v3).

A job owns its run folder: inside its sandbox it may put a link, a fifo, a device or a swapped
file wherever the worker expects a log, a checkpoint or a folder. The worker runs outside the
sandbox (as root, on most hosts), so a path it opens by name there is a path the job chose. So
every file the worker reads, hashes or uploads under a job's folders is opened here:

- relative to a folder descriptor the worker holds, one component at a time, never through a
  link (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, where the kernel has it; else
  `O_NOFOLLOW` per component), and never `..`;
- with `O_NONBLOCK`, so a fifo cannot hold the worker in `open()`;
- then checked with `fstat` on that same descriptor: a regular file (or a folder) or nothing;
  a file with other hard links is taken only when the job's own user owns it (a link to a host
  file is refused even where the kernel's `protected_hardlinks` is off);
- and read from that descriptor, never reopened by name: a swap after the check changes nothing.

Deleting takes no name from the job either: `remove_tree` removes only folders whose paths the
worker chose and keeps in memory, with coreutils' `rm -rf --one-file-system`, which never follows
a link and walks any depth (Python 3.11's `shutil.rmtree` recurses, and a job's folder 3000 deep
made it raise and leave everything behind).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import os
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_SYS_OPENAT2 = 437  # the same number on x86_64 and aarch64 (the generic syscall table)
_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x01, 0x02, 0x04, 0x08
_RESOLVE = _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
REMOVE_TIMEOUT_S = 600


class Refused(OSError):
    """What the job put there is not a file of its own: nothing is taken through it."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_has_openat2: bool | None = None  # learnt on first use


def _openat2(dir_fd: int, rel: str, flags: int) -> int | None:
    """The kernel's own confinement; None where the kernel (or a seccomp filter) lacks it."""
    global _has_openat2
    if _has_openat2 is False:
        return None
    how = _OpenHow(flags=flags, mode=0, resolve=_RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        _has_openat2 = True
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and _has_openat2 is None:
        _has_openat2 = False
        return None
    if err == errno.EXDEV:  # RESOLVE_BENEATH / NO_XDEV: a way out, or a mount crossed
        raise Refused(errno.EXDEV, "leaves the job's folder", rel)
    if err == errno.ELOOP:  # RESOLVE_NO_SYMLINKS met a link
        raise Refused(errno.ELOOP, "a link, not followed", rel)
    raise OSError(err, os.strerror(err), rel)


def _walk_open(dir_fd: int, parts: list[str], flags: int) -> int:
    """Component by component with O_NOFOLLOW: the same rules without openat2."""
    fd = os.dup(dir_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(part, (flags if last else _FLAGS | os.O_DIRECTORY), dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused(exc.errno, "a link, not followed", "/".join(parts)) from exc
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _split(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or rel.startswith("/"):
        raise Refused(errno.EXDEV, "not a path inside the job's folder", rel)
    return parts


def open_beneath(dir_fd: int, rel: str, *, folder: bool = False, owner: int | None = None) -> int:
    """A descriptor of the regular file (or folder) `rel` under `dir_fd`, or `Refused`.

    `FileNotFoundError` when nothing is there yet (a log torchrun has not made)."""
    parts = _split(rel)
    flags = _FLAGS | (os.O_DIRECTORY if folder else 0)
    fd = _openat2(dir_fd, "/".join(parts), flags)
    if fd is None:
        fd = _walk_open(dir_fd, parts, flags)
    try:
        _check(os.fstat(fd), rel, folder, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check(st: os.stat_result, rel: str, folder: bool, owner: int | None) -> None:
    wanted = stat.S_ISDIR if folder else stat.S_ISREG
    if not wanted(st.st_mode):
        raise Refused(errno.EINVAL, "not a regular file" if not folder else "not a folder", rel)
    if not folder and st.st_nlink > 1 and owner is not None and st.st_uid != owner:
        raise Refused(errno.EPERM, "a hard link to a file that is not the job's", rel)


def open_folder(path: Path) -> int:
    """A folder whose path the worker chose (a run folder): opened once, held, never a link."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    return fd


@dataclass(frozen=True)
class Entry:
    """One name in a job's folder, as `lstat` saw it (a link is a link, not its target)."""

    name: str
    st: os.stat_result

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.st.st_mode)

    @property
    def is_folder(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)


def entries(folder_fd: int) -> list[Entry]:
    """The names in a folder the worker holds open, with what each is (links not followed)."""
    found = []
    with os.scandir(folder_fd) as it:
        for entry in it:
            try:
                found.append(Entry(entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue
    return found


class JobFolder:
    """A job node's run folder, held open by the worker from the start to the end of the node.

    Everything the worker takes from the job goes through it. `owner` is the uid the job's
    ranks run as on the host (a root worker's sandbox user), None where that is the worker's.
    """

    def __init__(self, path: Path, owner: int | None = None) -> None:
        self.path, self.owner = path, owner
        self._fd: int | None = None

    def fd(self) -> int:
        if self._fd is None:
            self._fd = open_folder(self.path)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def open(self, rel: str) -> BinaryIO:
        """A regular file of the job's, for reading (its own descriptor: keep it to read on)."""
        return os.fdopen(open_beneath(self.fd(), rel, owner=self.owner), "rb", buffering=0)

    def open_sub(self, rel: str) -> int:
        """A folder of the job's (`""`: this one), as a descriptor the caller closes."""
        return open_beneath(self.fd(), rel, folder=True) if rel else os.dup(self.fd())

    def read_tail(self, rel: str, max_bytes: int) -> bytes:
        """The last `max_bytes` of a file, or b"" where there is none the worker may take."""
        try:
            with self.open(rel) as fh:
                size = os.fstat(fh.fileno()).st_size
                return os.pread(fh.fileno(), max_bytes, max(0, size - max_bytes))
        except OSError:
            return b""

    def find(self, pattern: str) -> list[str]:
        """Names matching a glob of `/`-separated parts (`*/attempt_*/0/stdout.log`), walked
        through real folders only, sorted. The last part may name anything but a folder: a link
        or a fifo there is found, so that `open` can refuse it and say why."""
        return sorted(self._find(self.fd(), "", pattern.split("/")))

    def _find(self, fd: int, prefix: str, parts: list[str]) -> Iterator[str]:
        head, rest = parts[0], parts[1:]
        for entry in entries(fd):
            if not fnmatch.fnmatchcase(entry.name, head) or entry.name.startswith("."):
                continue
            rel = f"{prefix}{entry.name}"
            if not rest:
                if not entry.is_folder:
                    yield rel
                continue
            if not entry.is_folder:
                continue
            try:
                sub = open_beneath(fd, entry.name, folder=True)
            except OSError:
                continue
            try:
                yield from self._find(sub, rel + "/", rest)
            finally:
                os.close(sub)


def remove_tree(path: Path) -> None:
    """A folder of the worker's choosing and all under it, however the job shaped it; nothing
    through a link, nothing on another filesystem mounted inside."""
    if not os.path.lexists(path):
        return
    # what is left on a failure goes at the worker's next start (agent.remove_stale_runs)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=REMOVE_TIMEOUT_S,
            check=False,
        )
