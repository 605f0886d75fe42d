"""Reading what a node's ranks leave on disk: log files, the events file, checkpoint files.

Each reader remembers how far it got, so every byte and every line is taken exactly once.
A reader takes at most `MAX_READ` bytes of a file per look and says so (`backlog`) when it
left more behind: the supervisor then looks again sooner, and at the end until none is left.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_READ = 4 * 1024 * 1024
HOLD_MAX = 64 * 1024  # a partial line longer than this goes out anyway
HOLD_S = 2.0  # and so does one that has waited this long for its end
IGNORED_SUFFIXES = (".tmp", ".partial")


class FileTail:
    """New bytes of a growing file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read_new(self, limit: int = MAX_READ) -> bytes:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(limit)
        except FileNotFoundError:
            return b""
        self.offset += len(data)
        return data


class EventsTail:
    """Complete JSON lines appended to the events file; a half-written last line waits."""

    def __init__(self, path: Path) -> None:
        self.tail = FileTail(path)
        self.buffer = b""
        self.backlog = False

    def waiting(self) -> bool:
        """Bytes were appended since the last read (one `stat`: cheap enough to ask often)."""
        try:
            return os.stat(self.tail.path).st_size > self.tail.offset
        except FileNotFoundError:
            return False

    def read_new(self) -> list[dict[str, Any]]:
        new = self.tail.read_new()
        self.backlog = len(new) >= MAX_READ
        self.buffer += new
        *lines, self.buffer = self.buffer.split(b"\n")
        events = []
        for line in lines:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                events.append(obj)
        return events


class RankLogs:
    """One local rank's stdout and stderr (torchrun --redirects=3) as one combined stream.

    Each look appends the new bytes of stdout, then those of stderr. So that a line of one is
    never cut in two by the other, a stream's unfinished last line (after its last newline or
    carriage return) waits for its end: for at most `HOLD_S` seconds or `HOLD_MAX` bytes, and
    never past the final look.
    """

    def __init__(self, logs_dir: Path, local_rank: int, preface: Path | None = None) -> None:
        self.logs_dir, self.local_rank = logs_dir, local_rank
        self.preface = preface  # read once, first: what happened on the node before the rank
        self.streams: list[FileTail] = []
        self.held: list[bytes] = []
        self.held_since: list[float] = []
        self.offset = 0
        self.backlog = False
        self.notes: list[bytes] = []  # the worker's own lines for this log (a stall's stacks)
        self.last_byte = b""

    def note(self, text: str) -> None:
        """Lines of the worker's, put in the combined stream at the next look, between whole
        lines of the rank's: a `[stall]` header and the rank's stack (contract §8)."""
        self.notes.append(text.encode(errors="replace").rstrip(b"\n") + b"\n")

    def _find(self) -> None:
        if self.streams:
            return
        for name in ("stdout.log", "stderr.log"):
            found = sorted(self.logs_dir.glob(f"*/attempt_*/{self.local_rank}/{name}"))
            if found:
                self.streams.append(FileTail(found[-1]))
        if len(self.streams) != 2:
            self.streams = []
        self.held = [b""] * len(self.streams)
        self.held_since = [0.0] * len(self.streams)

    def read_new(self, final: bool = False, now: float | None = None) -> tuple[int, bytes]:
        """(offset of the returned bytes in the combined stream, the bytes)."""
        self._find()
        now = time.monotonic() if now is None else now
        start = self.offset
        self.backlog = False
        parts = [self._take_preface()]
        if self.notes:  # on a line of their own, even after a partial line the hold let out
            before = parts[0][-1:] or self.last_byte  # the last byte the log shows so far
            ended = before in (b"", b"\n", b"\r")
            parts += [b"" if ended else b"\n", *self.notes]
            self.notes = []
        for i, tail in enumerate(self.streams):
            new = tail.read_new()
            drained = len(new) < MAX_READ
            self.backlog = self.backlog or not drained
            if not self.held[i] and new:
                self.held_since[i] = now
            data = self.held[i] + new
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
            rest = len(data) - cut
            if (final and drained) or rest > HOLD_MAX or (rest and now - self.held_since[i] >= HOLD_S):
                cut = len(data)
            parts.append(data[:cut])
            self.held[i] = data[cut:]
            if self.held[i] and cut:
                self.held_since[i] = now
        data = b"".join(parts)
        self.offset += len(data)
        if data:
            self.last_byte = data[-1:]
        return start, data

    def _take_preface(self) -> bytes:
        path, self.preface = self.preface, None
        try:
            return path.read_bytes() if path is not None else b""
        except OSError:
            return b""

    def stderr_path(self) -> Path | None:
        self._find()
        return self.streams[1].path if self.streams else None

    def error_file(self) -> Path | None:
        found = sorted(self.logs_dir.glob(f"*/attempt_*/{self.local_rank}/error.json"))
        return found[-1] if found else None


@dataclass(frozen=True)
class FoundCheckpoint:
    path: Path
    size: int
    version: int = 0  # how many earlier files of this name were taken (a script's `last.pt`)


Signature = tuple[int, int, int]  # size, mtime_ns, inode


class CheckpointWatcher:
    """Complete files in the checkpoint folder, in the order written.

    Complete: unchanged in size, mtime and inode over two looks (renamed into place, or closed
    and no longer growing), or anything left once the ranks have exited. Names ending in .tmp
    or .partial and names starting with "." are never taken. A file written again under a name
    already taken (renamed over it, or rewritten in place) is a new file that appeared: it is
    taken again, with the next `version`.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seen: dict[str, Signature] = {}
        self.taken: dict[str, Signature] = {}
        self.versions: dict[str, int] = {}

    def poll(self, final: bool = False) -> list[FoundCheckpoint]:
        ready = []
        for entry in self._candidates():
            st = entry.stat()
            sig = (st.st_size, st.st_mtime_ns, st.st_ino)
            if self.taken.get(entry.name) == sig:
                continue
            stable = self.seen.get(entry.name) == sig
            self.seen[entry.name] = sig
            if stable or final:
                ready.append((st.st_mtime_ns, entry.name, sig, Path(entry.path), st.st_size))
        ready.sort()
        found = []
        for _, name, sig, path, size in ready:
            version = self.versions.get(name, -1) + 1
            self.taken[name], self.versions[name] = sig, version
            found.append(FoundCheckpoint(path=path, size=size, version=version))
        return found

    def _candidates(self) -> list[os.DirEntry[str]]:
        try:
            entries = list(os.scandir(self.folder))
        except FileNotFoundError:
            return []
        return [
            e
            for e in entries
            if e.is_file(follow_symlinks=False)
            and not e.name.startswith(".")
            and not e.name.endswith(IGNORED_SUFFIXES)
        ]


EPOCH_IN_NAME = re.compile(r"epoch[-_]?(\d+)", re.IGNORECASE)


def epoch_from_name(name: str) -> int | None:
    match = EPOCH_IN_NAME.search(name)
    return int(match.group(1)) if match else None
