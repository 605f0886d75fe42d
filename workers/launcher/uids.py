"""A uid of its own for every job node on a root worker (contract §7 v3).

One sandbox user for every job let a later job of another user find what the first one left
under that uid: a kernel key, a process limit shared, a file it owned. Here each node (and each
warm spare sandbox, whose uid its node inherits) takes the next uid of `TORCHJOBS_JOB_UIDS`
(a range no account uses; the group is the same number), from a counter shared by every worker
on the host (a file under `STATE`, taken with `flock`), so no two jobs run as one uid, and a uid
comes round again only after the whole range was used, and then only when no process of it is
left. Its files go with the node's folders; seccomp.py refuses it the kernel's keyrings.

A worker that is not root (user namespaces) cannot do this: its ranks are its own uid on the
host whatever they are inside (docs/security.md says what that mode gives).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

STATE = Path("/var/lib/torchjobs/next-job-uid")


@dataclass(frozen=True)
class UidRange:
    first: int
    last: int

    def __post_init__(self) -> None:
        if not 1000 <= self.first <= self.last <= 0xFFFFFFFE - 1:
            raise ValueError("TORCHJOBS_JOB_UIDS: a range FIRST-LAST of uids from 1000 up")


def parse(text: str) -> UidRange | None:
    """`FIRST-LAST`, or `off` (every job runs as TORCHJOBS_SANDBOX_USER, as before v3)."""
    if text.strip().lower() == "off":
        return None
    first, sep, last = text.partition("-")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"TORCHJOBS_JOB_UIDS: {text!r} is not FIRST-LAST or off")
    return UidRange(int(first), int(last))


class UidPool:
    def __init__(self, uids: UidRange, counter: Path = STATE) -> None:
        self.uids, self.counter = uids, counter

    def take(self) -> int:
        """The next uid no process holds, for one node (or spare) only."""
        self.counter.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.counter, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "r+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            text = fh.read().strip()
            uid = int(text) if text.isdigit() else self.uids.first
            held = uids_in_use()
            for _ in range(min(len(held) + 1, self.size)):
                uid = uid if self.uids.first <= uid <= self.uids.last else self.uids.first
                if uid not in held:
                    break
                uid += 1
            else:
                raise RuntimeError("TORCHJOBS_JOB_UIDS: every uid of the range has a process")
            fh.seek(0)
            fh.truncate()
            fh.write(str(uid + 1))
        return uid

    @property
    def size(self) -> int:
        return self.uids.last - self.uids.first + 1


def uids_in_use() -> set[int]:
    """The real uids of every process on this host (a uid with a process is never handed out)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.add(os.stat(f"/proc/{entry}").st_uid)
            except OSError:
                continue
    return found
