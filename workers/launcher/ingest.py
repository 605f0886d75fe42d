"""Reading what a node's ranks leave on disk: log files, the events file, checkpoint files.

Each reader remembers how far it got, so every byte and every line is taken exactly once.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_READ = 4 * 1024 * 1024
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

    def read_new(self) -> list[dict[str, Any]]:
        self.buffer += self.tail.read_new()
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
    """One local rank's stdout and stderr (torchrun --redirects=3) as one combined stream."""

    def __init__(self, logs_dir: Path, local_rank: int) -> None:
        self.logs_dir, self.local_rank = logs_dir, local_rank
        self.streams: list[FileTail] = []
        self.offset = 0

    def _find(self) -> None:
        if self.streams:
            return
        for name in ("stdout.log", "stderr.log"):
            found = sorted(self.logs_dir.glob(f"*/attempt_*/{self.local_rank}/{name}"))
            if found:
                self.streams.append(FileTail(found[-1]))
        if len(self.streams) != 2:
            self.streams = []

    def read_new(self) -> tuple[int, bytes]:
        """(offset of the returned bytes in the combined stream, the bytes)."""
        self._find()
        start = self.offset
        data = b"".join(s.read_new() for s in self.streams)
        self.offset += len(data)
        return start, data

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


class CheckpointWatcher:
    """Complete files in the checkpoint folder, in the order written.

    Complete: unchanged in size and mtime over two looks (renamed into place, or closed and
    no longer growing), or anything left once the ranks have exited. Names ending in .tmp or
    .partial and names starting with "." are never taken.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seen: dict[str, tuple[int, int]] = {}
        self.taken: set[str] = set()

    def poll(self, final: bool = False) -> list[FoundCheckpoint]:
        ready = []
        for entry in self._candidates():
            st = entry.stat()
            sig = (st.st_size, st.st_mtime_ns)
            stable = self.seen.get(entry.name) == sig
            self.seen[entry.name] = sig
            if stable or final:
                ready.append(
                    (st.st_mtime_ns, entry.name, FoundCheckpoint(path=Path(entry.path), size=st.st_size))
                )
        ready.sort()
        for _, name, _ in ready:
            self.taken.add(name)
        return [f for _, _, f in ready]

    def _candidates(self) -> list[os.DirEntry[str]]:
        try:
            entries = list(os.scandir(self.folder))
        except FileNotFoundError:
            return []
        return [
            e
            for e in entries
            if e.is_file(follow_symlinks=False)
            and e.name not in self.taken
            and not e.name.startswith(".")
            and not e.name.endswith(IGNORED_SUFFIXES)
        ]


EPOCH_IN_NAME = re.compile(r"epoch[-_]?(\d+)", re.IGNORECASE)


def epoch_from_name(name: str) -> int | None:
    match = EPOCH_IN_NAME.search(name)
    return int(match.group(1)) if match else None
