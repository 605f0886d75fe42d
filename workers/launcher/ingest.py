"""Reading what a node's ranks leave on disk: log files, the events file, checkpoint files.

All of it goes through `jobfiles`: the job owns these folders, so nothing here opens a path by
name; a link, a fifo or a swapped file is never taken (contract §7 v3).
Each reader remembers how far it got, so every byte and every line is taken exactly once.
A reader takes at most `MAX_READ` bytes of a file per look and says so (`backlog`) when it
left more behind: the supervisor then looks again sooner, and at the end until none is left.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from workers.launcher.jobfiles import JobFolder, Refused, entries, open_beneath

MAX_READ = 4 * 1024 * 1024
HOLD_MAX = 64 * 1024  # a partial line longer than this goes out anyway
HOLD_S = 2.0  # and so does one that has waited this long for its end
LOG_MAX_BYTES = 100 * 1024 * 1024  # each rank's stored log per attempt (TORCHJOBS_LOG_MAX_MB)
IGNORED_SUFFIXES = (".tmp", ".partial")
MAX_CHECKPOINTS = 10_000  # checkpoint files one node takes per attempt
SPARSE_FROM = 64 * 1024 * 1024  # a larger file with under half its size on disk is refused
MAX_EVENT_LINE = 1024 * 1024  # a longer events line is no event: dropped, never held in memory


class FileTail:
    """New bytes of a growing file since the last read.

    The file is opened once, through `jobfiles`, and read from that descriptor from then on:
    what the job later puts under the name (a link, a fifo) is never looked at. `refused` says
    why the name was not taken, for the job's own log to show."""

    def __init__(self, folder: JobFolder, rel: str) -> None:
        self.folder, self.rel = folder, rel
        self.offset = 0
        self.fh: BinaryIO | None = None
        self.refused: str | None = None

    def _opened(self) -> BinaryIO | None:
        if self.fh is None:
            try:
                self.fh = self.folder.open(self.rel)
            except Refused as exc:
                self.refused = f"{self.rel}: {exc.strerror}"
            except OSError:  # not there yet, or the folder itself not taken
                pass
        return self.fh

    def size(self) -> int:
        fh = self._opened()
        return os.fstat(fh.fileno()).st_size if fh is not None else 0

    def read_new(self, limit: int = MAX_READ) -> bytes:
        fh = self._opened()
        if fh is None:
            return b""
        data = os.pread(fh.fileno(), limit, self.offset)
        self.offset += len(data)
        return data

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


class EventsTail:
    """Complete JSON lines appended to the events file; a half-written last line waits."""

    def __init__(self, folder: JobFolder, rel: str) -> None:
        self.tail = FileTail(folder, rel)
        self.skipping = False  # inside a line too long to be an event
        self.buffer = b""
        self.backlog = False

    def waiting(self) -> bool:
        """Bytes were appended since the last read (one `fstat`: cheap enough to ask often)."""
        return self.tail.size() > self.tail.offset

    def read_new(self) -> list[dict[str, Any]]:
        new = self.tail.read_new()
        self.backlog = len(new) >= MAX_READ
        *lines, rest = (self.buffer + new).split(b"\n")
        if self.skipping and lines:  # the end of a line too long to be an event
            lines, self.skipping = lines[1:], False
        if self.skipping or len(rest) > MAX_EVENT_LINE:  # dropped up to its end, never held
            rest, self.skipping = b"", True
        self.buffer = rest
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

    The stream is capped at `max_bytes` (contract §7 v3): a job cannot fill the database with
    output. The look that would pass it gives the bytes up to the cap, then a line saying where
    it was cut, once; from then on the rank's files are not read again. The worker's own notes
    (a stall's stacks) still go in after the cut: they are few, and say why the job ended.
    """

    def __init__(
        self,
        folder: JobFolder,
        local_rank: int,
        preface: Path | None = None,
        logs: str = "logs",
        max_bytes: int = LOG_MAX_BYTES,
    ) -> None:
        self.logs, self.local_rank = folder, local_rank
        self.prefix = f"{logs}/" if logs else ""  # where torchrun's --log-dir is in the folder
        self.preface = preface  # read once, first: what happened on the node before the rank
        self.streams: list[FileTail] = []
        self.held: list[bytes] = []
        self.held_since: list[float] = []
        self.offset = 0
        self.backlog = False
        self.notes: list[bytes] = []  # the worker's own lines for this log (a stall's stacks)
        self.last_byte = b""
        self.noted: set[str] = set()
        self.room = max_bytes  # bytes the stream may still take before it is cut
        self.cut = False  # the cap was reached: the rank's files are no longer read
        self.cut_line = self._cut_line(max_bytes)
        self.sizes_past_cut: list[int] = []
        self.talking = False  # past the cut, the rank's files grew since the last look

    @staticmethod
    def _cut_line(max_bytes: int) -> bytes:
        """The line that ends the rank's part of the log, naming the setting to raise."""
        mb = max_bytes / (1024 * 1024)
        shown = f"{mb:.3g}" if mb < 1 else f"{round(mb, 3):g}"
        return (
            f"[torchjobs] log cut at {shown} MB (TORCHJOBS_LOG_MAX_MB): the rest of this rank's "
            "output in this attempt is not stored\n"
        ).encode()

    def note(self, text: str) -> None:
        """Lines of the worker's, put in the combined stream at the next look, between whole
        lines of the rank's: a `[stall]` header and the rank's stack (contract §8)."""
        self.notes.append(text.encode(errors="replace").rstrip(b"\n") + b"\n")

    def _find(self) -> None:
        if self.streams:
            return
        for name in ("stdout.log", "stderr.log"):
            try:
                found = self.logs.find(f"{self.prefix}*/attempt_*/{self.local_rank}/{name}")
            except OSError:  # the logs folder not there yet, or not a folder the worker takes
                found = []
            if found:
                self.streams.append(FileTail(self.logs, found[-1]))
        if len(self.streams) != 2:
            self.streams = []
        self.held = [b""] * len(self.streams)
        self.held_since = [0.0] * len(self.streams)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    def _note_refusals(self) -> None:
        """Once each: the rank's log says which of its files the worker would not read."""
        for stream in self.streams:
            if stream.refused and stream.refused not in self.noted:
                self.noted.add(stream.refused)
                self.note(f"[torchjobs] not read, not a regular file of the job's: {stream.refused}")

    def refusals(self) -> list[str]:
        """What the rank put where its logs go that the worker did not take, and why."""
        return [s.refused for s in self.streams if s.refused]

    def read_new(self, final: bool = False, now: float | None = None) -> tuple[int, bytes]:
        """(offset of the returned bytes in the combined stream, the bytes)."""
        self._find()
        self._note_refusals()
        now = time.monotonic() if now is None else now
        start = self.offset
        self.backlog = False
        parts = [self._capped(self._take_preface(), self.last_byte)]
        parts += self._take_notes(self._last(parts))
        for i, tail in enumerate(self.streams):
            if self.cut:  # nothing more of the rank's is stored: not even read
                break
            parts.append(self._capped(self._take_lines(i, tail, final, now), self._last(parts)))
        if self.cut:
            self.held, self.backlog = [b""] * len(self.streams), False
            self._listen_past_the_cut()
        data = b"".join(parts)
        self.offset += len(data)
        if data:
            self.last_byte = data[-1:]
        return start, data

    def _take_notes(self, before: bytes) -> list[bytes]:
        """The worker's notes, on a line of their own even after a partial line the hold let
        out (`before`: the last byte the log shows so far). Never cut: they are few, and say
        why the job ended; they still count against the cap."""
        if not self.notes:
            return []
        ended = before in (b"", b"\n", b"\r")
        parts, self.notes = [b"" if ended else b"\n", *self.notes], []
        self.room -= sum(map(len, parts))
        return parts

    def _listen_past_the_cut(self) -> None:
        """Output past the cap is not stored, but it is still the rank speaking: its files'
        sizes (one `fstat` each) tell the stall clock so (contract §8 counts any log byte)."""
        sizes = [tail.size() for tail in self.streams]
        self.talking = bool(self.sizes_past_cut) and sizes != self.sizes_past_cut
        self.sizes_past_cut = sizes

    def _take_lines(self, i: int, tail: FileTail, final: bool, now: float) -> bytes:
        """Stream `i`'s new bytes up to its last line end; the unfinished rest is held (above)."""
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
        self.held[i] = data[cut:]
        if self.held[i] and cut:
            self.held_since[i] = now
        return data[:cut]

    def _last(self, parts: list[bytes]) -> bytes:
        """The last byte of the stream so far: of this look's parts, else of earlier looks."""
        return next((p[-1:] for p in reversed(parts) if p), self.last_byte)

    def _capped(self, data: bytes, before: bytes) -> bytes:
        """The rank's `data` as far as the cap lets it in; where it passes the cap, the cut line
        (on a line of its own after `before`, the byte the stream ends with so far)."""
        if self.cut or not data:
            return b""
        if len(data) <= self.room:
            self.room -= len(data)
            return data
        kept = data[: max(self.room, 0)]
        self.cut, self.room = True, 0
        ended = (kept[-1:] or before) in (b"", b"\n")
        return kept + (b"" if ended else b"\n") + self.cut_line

    def _take_preface(self) -> bytes:
        path, self.preface = self.preface, None
        try:
            return path.read_bytes() if path is not None else b""
        except OSError:
            return b""

    def stderr_tail(self, max_bytes: int) -> bytes:
        self._find()
        return self.logs.read_tail(self.streams[1].rel, max_bytes) if self.streams else b""

    def error_file(self) -> bytes:
        """What torchrun's `@record` wrote for this rank (at most 1 MiB), or b""."""
        try:
            found = self.logs.find(f"{self.prefix}*/attempt_*/{self.local_rank}/error.json")
        except OSError:
            return b""
        return self.logs.read_tail(found[-1], 1024 * 1024) if found else b""


@dataclass(frozen=True)
class FoundCheckpoint:
    """A complete checkpoint file, already open: the upload reads this descriptor, never the name,
    and exactly the `size` bytes that were seen complete (`Exactly`)."""

    name: str
    file: Exactly
    size: int
    version: int = 0  # how many earlier files of this name were taken (a script's `last.pt`)


class CheckpointChanged(OSError):
    """The file shrank while it was stored: not the file that was complete; not taken."""


class Exactly:
    """A checkpoint's bytes, as many as were seen complete: a file the job grows (or truncates
    to 16 TiB) while it is stored is read no further than that."""

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh, self.size, self.left = fh, size, size

    def read(self, n: int = -1) -> bytes:
        want = self.left if n < 0 else min(n, self.left)
        data = self.fh.read(want) if want else b""
        if want and not data:
            raise CheckpointChanged(f"shrank while stored ({self.size - self.left} of {self.size} bytes)")
        self.left -= len(data)
        return data

    def seek(self, offset: int) -> None:
        self.fh.seek(offset)
        self.left = self.size - offset

    def close(self) -> None:
        self.fh.close()


Signature = tuple[int, int, int]  # size, mtime_ns, inode


class CheckpointWatcher:
    """Complete files in the checkpoint folder, in the order written.

    Complete: unchanged in size, mtime and inode over two looks (renamed into place, or closed
    and no longer growing), or anything left once the ranks have exited. Names ending in .tmp
    or .partial and names starting with "." are never taken. A file written again under a name
    already taken (renamed over it, or rewritten in place) is a new file that appeared: it is
    taken again, with the next `version`.
    """

    def __init__(self, folder: JobFolder, sub: str = "checkpoints", max_bytes: int | None = None) -> None:
        self.folder, self.sub = folder, sub  # looked up anew at each poll: a script may remake it
        self.max_bytes = max_bytes  # a file larger than the node may keep is no checkpoint
        self.refused: list[str] = []  # names not taken, and why, for the worker's log
        self.seen: dict[str, Signature] = {}
        self.taken: dict[str, Signature] = {}
        self.versions: dict[str, int] = {}

    def poll(self, final: bool = False) -> list[FoundCheckpoint]:
        try:
            fd = self.folder.open_sub(self.sub)
        except OSError:  # not made yet, or not a folder the worker takes
            return []
        try:
            return self._poll(fd, final)
        finally:
            os.close(fd)

    def _poll(self, fd: int, final: bool) -> list[FoundCheckpoint]:
        ready = []
        for name, st in self._candidates(fd):
            sig = (st.st_size, st.st_mtime_ns, st.st_ino)
            if self.taken.get(name) == sig:
                continue
            stable = self.seen.get(name) == sig
            self.seen[name] = sig
            if stable or final:
                ready.append((st.st_mtime_ns, name, sig))
        ready.sort()
        found = []
        for _, name, sig in ready:
            if len(self.taken) >= MAX_CHECKPOINTS:
                self._refuse(name, sig, f"more than {MAX_CHECKPOINTS} checkpoint files in one attempt")
                continue
            opened = self._open_as_seen(fd, name, sig)
            if opened is None:
                continue
            version = self.versions.get(name, -1) + 1
            self.taken[name], self.versions[name] = sig, version
            found.append(
                FoundCheckpoint(name=name, file=Exactly(opened, sig[0]), size=sig[0], version=version)
            )
        return found

    def take_refusals(self) -> list[str]:
        found, self.refused = self.refused, []
        return found

    def adopt(self, name: str) -> None:
        """The resumed checkpoint the worker placed here itself (contract §11): not taken
        again unless it changes."""
        fd = self.folder.open_sub(self.sub)
        try:
            st = next((e.st for e in entries(fd) if e.name == name and e.is_file), None)
        finally:
            os.close(fd)
        if st is not None:
            self.taken[name] = (st.st_size, st.st_mtime_ns, st.st_ino)

    def _refuse(self, name: str, sig: Signature, why: str) -> None:
        """Never looked at again in this form (its signature counts as taken)."""
        self.taken[name] = sig
        self.refused.append(f"{name!r}: {why}")

    def _open_as_seen(self, fd: int, name: str, sig: Signature) -> BinaryIO | None:
        """The file under `name`, only if it is still the very file that was complete: a name
        swapped for a link, or for another file, since the look is not taken (a new file is
        looked at again next time)."""
        try:
            fh = os.fdopen(open_beneath(fd, name, owner=self.folder.owner), "rb", buffering=0)
        except OSError:
            self.seen.pop(name, None)
            return None
        st = os.fstat(fh.fileno())
        if (st.st_size, st.st_mtime_ns, st.st_ino) != sig:
            fh.close()
            self.seen.pop(name, None)
            return None
        why = self._not_a_checkpoint(st)
        if why:
            fh.close()
            self._refuse(name, sig, why)
            return None
        return fh

    def _not_a_checkpoint(self, st: os.stat_result) -> str | None:
        if self.max_bytes is not None and st.st_size > self.max_bytes:
            return f"{st.st_size} bytes, more than the node may keep ({self.max_bytes})"
        if st.st_size > SPARSE_FROM and st.st_blocks * 512 < st.st_size // 2:
            return "a sparse file (mostly holes): not a checkpoint"
        return None

    def _candidates(self, fd: int) -> list[tuple[str, os.stat_result]]:
        return [
            (e.name, e.st)
            for e in entries(fd)
            if e.is_file
            and not e.name.startswith(".")
            and not e.name.endswith(IGNORED_SUFFIXES)
            and storable_name(e.name)
        ]


def storable_name(name: str) -> bool:
    """A name the database and every client can hold: UTF-8 (os.scandir gives undecodable bytes
    as lone surrogates), no control characters, at most 255 bytes."""
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return len(encoded) <= 255 and not any(ord(c) < 32 or ord(c) == 127 for c in name)


def checkpoint_meta(event: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """What a rank said of a checkpoint, as far as it fits its row: whole numbers in range,
    metrics of finite numbers under storable names (the event is the job's own text)."""
    event = event or {}
    meta: dict[str, Any] = {}
    for key in ("epoch", "step"):
        value = event.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31:
            meta[key] = value
    meta.setdefault("epoch", epoch_from_name(name) if "epoch" not in event else None)
    metrics = event.get("metrics")
    if isinstance(metrics, dict):
        meta["metrics"] = {
            k: v
            for k, v in list(metrics.items())[:100]
            if isinstance(k, str) and storable_name(k) and isinstance(v, int | float) and math.isfinite(v)
        }
    return meta


EPOCH_IN_NAME = re.compile(r"epoch[-_]?(\d+)", re.IGNORECASE)


def epoch_from_name(name: str) -> int | None:
    match = EPOCH_IN_NAME.search(name)
    return int(match.group(1)) if match else None
