"""Folder checkpoints as frameworks write them (contract §11): looked at, judged complete, streamed.

A folder in the checkpoint folder is the job's: at any moment a rank may swap one of its files
for a link, a fifo or another file, or grow and shrink it. So, as for a checkpoint file
(ingest.py), nothing here opens a path by name from the host's side: the folder is walked
through descriptors (`jobfiles.open_beneath`, one component at a time, no link followed,
`O_NONBLOCK`), each file is checked with `fstat` on the descriptor it is read from, and read
once, as many bytes as the look saw, its SHA-256 computed on the way by the storage. A file
that is not what the look saw any more is not taken: the folder waits for the next look.

A walk is bounded (files, depth, path length): a job cannot make the worker hold a million
names or recurse without end.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from workers.launcher.ingest import SPARSE_FROM, CheckpointChanged, Exactly, storable_name
from workers.launcher.jobfiles import JobFolder, Refused, entries, open_beneath

MAX_FOLDER_FILES = 100_000  # files in one folder checkpoint
MAX_DEPTH = 32  # folders inside a folder checkpoint
MAX_PATH_BYTES = 1024  # a file's path inside the folder (the database column)
DONE_DIR = ".torchjobs-done"  # where `checkpoint_done(NAME)` leaves NAME (workers/runtime/marks.py)
# the marks a framework leaves when it is done (DCP's coordinator writes .metadata last;
# HF Trainer writes trainer_state.json after the model, optimizer and RNG states)
DONE_FILES = (".metadata", "trainer_state.json")

FileSig = tuple[str, int, int, int]  # path, size, mtime_ns, inode
FolderSig = tuple[FileSig, ...]


class FolderRefused(Exception):
    """The folder is not a checkpoint the worker takes (too many files, too deep)."""


@dataclass(frozen=True)
class FolderLook:
    """What one walk found: every regular file, sorted by path (UTF-8 bytes), and why not more."""

    files: FolderSig
    skipped: tuple[str, ...] = ()  # links, fifos, unstorable names: not followed, not kept

    @property
    def size(self) -> int:
        return sum(f[1] for f in self.files)


def walk(dir_fd: int, name: str, owner: int | None = None, max_bytes: int | None = None) -> FolderLook:
    """The regular files beneath the folder `name` of `dir_fd`, never through a link. Not kept
    either: a hard link to a file that is not the job's (`owner`), a sparse file (mostly
    holes: terabytes of zeros to read). More than `max_bytes` in all refuses the folder."""
    fd = open_beneath(dir_fd, name, folder=True)
    files: list[FileSig] = []
    skipped: list[str] = []
    try:
        _walk(fd, "", 0, files, skipped, owner)
    finally:
        os.close(fd)
    if max_bytes is not None and sum(f[1] for f in files) > max_bytes:
        raise FolderRefused(f"more than the node may keep ({max_bytes} bytes)")
    files.sort(key=lambda f: f[0].encode())
    return FolderLook(files=tuple(files), skipped=tuple(skipped[:20]))


def _walk(
    fd: int, prefix: str, depth: int, files: list[FileSig], skipped: list[str], owner: int | None
) -> None:
    for entry in entries(fd):
        rel = prefix + entry.name
        if not storable_name(entry.name) or len(rel.encode()) > MAX_PATH_BYTES or _foreign(entry.st, owner):
            skipped.append(repr(rel))
            continue
        if entry.is_file:
            if len(files) >= MAX_FOLDER_FILES:
                raise FolderRefused(f"more than {MAX_FOLDER_FILES} files")
            st = entry.st
            files.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
        elif entry.is_folder:
            if depth + 1 > MAX_DEPTH:
                raise FolderRefused(f"folders more than {MAX_DEPTH} deep")
            try:
                sub = open_beneath(fd, entry.name, folder=True)
            except OSError:  # swapped for a link or removed since the listing
                skipped.append(repr(rel))
                continue
            try:
                _walk(sub, rel + "/", depth + 1, files, skipped, owner)
            finally:
                os.close(sub)
        else:
            skipped.append(repr(rel))


def _foreign(st: os.stat_result, owner: int | None) -> bool:
    """A file not to take: a hard link to another user's file, or a sparse one."""
    if not stat.S_ISREG(st.st_mode):
        return False
    if st.st_nlink > 1 and owner is not None and st.st_uid != owner:
        return True
    return st.st_size > SPARSE_FROM and st.st_blocks * 512 < st.st_size // 2


def open_as_seen(dir_fd: int, name: str, sig: FileSig, owner: int | None) -> Exactly:
    """The file `sig` names in the folder `name`, only if it is still the very file the look
    saw (size, mtime, inode), as exactly those bytes; else `CheckpointChanged`."""
    path, size, mtime, ino = sig
    try:
        fd = open_beneath(dir_fd, f"{name}/{path}", owner=owner)
    except Refused as exc:
        raise CheckpointChanged(f"{path}: {exc.strerror}") from exc
    except OSError as exc:
        raise CheckpointChanged(f"{path}: gone ({exc.strerror})") from exc
    fh = os.fdopen(fd, "rb", buffering=0)
    st = os.fstat(fd)
    if (st.st_size, st.st_mtime_ns, st.st_ino) != (size, mtime, ino):
        fh.close()
        raise CheckpointChanged(f"{path}: changed since the look")
    return Exactly(fh, size)


def chunks(source: Exactly, chunk: int = 1024 * 1024) -> Iterator[bytes]:
    """The file's bytes, each read once (the storage hashes them on the way)."""
    return iter(lambda: source.read(chunk), b"")


def done_names(dir_fd: int) -> set[str]:
    """The names ranks marked done with `checkpoint_done` (empty files in DONE_DIR: only
    their names are read, and only names of storable form)."""
    try:
        fd = open_beneath(dir_fd, DONE_DIR, folder=True)
    except OSError:
        return set()
    try:
        return {e.name for e in entries(fd)[:10_000] if storable_name(e.name)}
    finally:
        os.close(fd)


@dataclass
class FolderState:
    """What the watcher knows of one folder: its last look, when it last changed, what was taken."""

    sig: FolderSig | None = None
    changed_at: float = 0.0
    looks_same: int = 0  # consecutive looks that found it unchanged
    taken: FolderSig | None = None
    version: int = -1
    refused: bool = False


@dataclass(frozen=True)
class FoundFolder:
    """A complete folder checkpoint: `files` as the look saw them; each is opened and checked
    again when it is streamed (`open_as_seen`)."""

    name: str
    files: FolderSig
    version: int


@dataclass
class FolderRules:
    """When a folder is complete (contract §11). `lead`: node 0 (the marks count); on another
    node a folder is complete when unchanged over two looks (or at the end)."""

    settle_s: float = 10.0
    lead: bool = True
    states: dict[str, FolderState] = field(default_factory=dict)

    def look(self, name: str, files: FolderSig, done: bool, final: bool, now: float | None = None) -> bool:
        """Record a look at `name`; True when it is complete now and not taken in this form."""
        now = time.monotonic() if now is None else now
        state = self.states.setdefault(name, FolderState(changed_at=now))
        if files != state.sig:
            state.sig, state.changed_at, state.looks_same = files, now, 0
        else:
            state.looks_same += 1
        if state.refused or files == state.taken or not files:
            return False
        if final:
            return not (self.lead and _interrupted_dcp_save({f[0] for f in files}))
        stable = state.looks_same >= 1  # unchanged over two looks: nothing is mid-write
        if not self.lead:
            return stable
        top = {f[0] for f in files}
        if _interrupted_dcp_save(top):
            return False
        marked = done or any(mark in top for mark in DONE_FILES)
        return (marked and stable) or now - state.changed_at >= self.settle_s

    def taken(self, name: str, files: FolderSig) -> int:
        """Mark `files` taken; the version this take gets (0, then 1 for a rewrite...)."""
        state = self.states.setdefault(name, FolderState())
        state.taken, state.version = files, state.version + 1
        return state.version

    def adopt(self, name: str, files: FolderSig) -> None:
        """A folder the worker put there itself (a resumed checkpoint): not taken unless it changes."""
        state = self.states.setdefault(name, FolderState())
        state.sig = state.taken = files
        state.version += 1

    def untake(self, name: str, files: FolderSig) -> None:
        """Storing `files` failed (a file changed meanwhile, or the storage refused): looked at again."""
        state = self.states.get(name)
        if state is not None and state.taken == files:
            state.taken, state.version = None, state.version - 1

    def refuse(self, name: str) -> None:
        self.states.setdefault(name, FolderState()).refused = True

    def busy(self, present: set[str]) -> list[str]:
        """Names present whose current form is not taken (another node's part is not stored yet)."""
        return sorted(
            n
            for n in present
            if (s := self.states.get(n)) is not None and not s.refused and s.sig and s.sig != s.taken
        )


def _interrupted_dcp_save(top: set[str]) -> bool:
    """Shards of a DCP save (`__0_0.distcp`) without the `.metadata` its coordinator writes last:
    a save cut off (the job crashed or was killed mid-write), never a checkpoint, however long it
    settles or when the ranks exit. Listed, it would be every retry's latest checkpoint, and
    `dcp.load` refuses it: the job could never resume again."""
    return ".metadata" not in top and any(name.endswith(".distcp") for name in top)


IGNORED_SUFFIXES = (".tmp", ".partial")


def _saved_order(found: FoundFolder) -> tuple[int, str]:
    """Folders found in one look, oldest save first (by their newest file): they are stored,
    and so listed, in that order. By name, `checkpoint-1000` would come before `checkpoint-500`.
    The mtimes are the job's to set: a job that fakes them only misorders its own list."""
    return max((sig[2] for sig in found.files), default=0), found.name


class FolderWatcher:
    """The complete folders in the checkpoint folder (contract §11), each time it is rewritten.

    The folder is looked up anew at each poll through the job's run folder (`JobFolder`):
    a script may remake it."""

    def __init__(self, folder: JobFolder, sub: str, rules: FolderRules, max_bytes: int | None = None) -> None:
        self.folder, self.sub, self.rules = folder, sub, rules
        self.max_bytes = max_bytes  # a folder larger than the node may keep is no checkpoint
        self.refused: list[str] = []
        self.present: set[str] = set()

    def poll(self, final: bool = False) -> list[FoundFolder]:
        try:
            fd = self.folder.open_sub(self.sub)
        except OSError:
            self.present = set()
            return []
        try:
            return self._poll(fd, final)
        finally:
            os.close(fd)

    def _poll(self, fd: int, final: bool) -> list[FoundFolder]:
        done = done_names(fd)
        names = [
            e.name
            for e in entries(fd)
            if e.is_folder
            and not e.name.startswith(".")
            and not e.name.endswith(IGNORED_SUFFIXES)
            and storable_name(e.name)
        ]
        self.present = set(names)
        found = []
        for name in sorted(names):
            state = self.rules.states.get(name)
            if state is not None and state.refused:
                continue
            try:
                look = walk(fd, name, self.folder.owner, self.max_bytes)
            except FolderRefused as exc:
                self.rules.refuse(name)
                self.refused.append(f"{name!r}: {exc}")
                continue
            except OSError:  # swapped for a link, or removed, since the listing
                continue
            if self.rules.look(name, look.files, name in done, final):
                version = self.rules.taken(name, look.files)
                found.append(FoundFolder(name=name, files=look.files, version=version))
        return sorted(found, key=_saved_order)

    def open_file(self, name: str, sig: FileSig) -> Exactly:
        """One file of a found folder, checked to be the file the look saw (a new descriptor of
        the checkpoint folder each time: the job may have remade it)."""
        fd = self.folder.open_sub(self.sub)
        try:
            return open_as_seen(fd, name, sig, self.folder.owner)
        finally:
            os.close(fd)

    def adopt(self, name: str) -> None:
        """The resumed checkpoint the worker placed here before the ranks started."""
        fd = self.folder.open_sub(self.sub)
        try:
            self.rules.adopt(name, walk(fd, name, self.folder.owner).files)
        finally:
            os.close(fd)

    def take_refusals(self) -> list[str]:
        found, self.refused = self.refused, []
        return found
