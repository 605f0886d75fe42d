"""How much a job node keeps on the host's disk: its run folder and its TMPDIR (contract §7 v3).

`TORCHJOBS_JOB_DISK_MAX_MB` per GPU bounds the bytes a node holds under its folders. No quota
filesystem is assumed (a loop-mounted image per node, or XFS project quotas, would enforce it in
the kernel; neither is on every host), so the supervisor looks: every `LOOK_EVERY_S` it adds up
the blocks of every file under both folders, walked as `jobfiles` walks (relative to folder
descriptors, links never followed, so a link to `/` costs nothing and counts nothing). A look
stops as soon as the sum passes the limit, and after `MAX_ENTRIES` names: a job that makes
millions of empty files is past the limit too. Between two looks a job can write more than its
limit: the limit is what it may keep, not a rate.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from workers.launcher.jobfiles import entries, open_beneath, open_folder

LOOK_EVERY_S = 5.0
MAX_ENTRIES = 1_000_000
MAX_DEPTH = 128  # folders deeper than this are past the limit too (each level holds a descriptor)
ENTRY_BYTES = 4096  # each name counts at least a block: a million empty files is a lot of disk


@dataclass
class Tally:
    limit: int
    bytes: int = 0
    names: int = 0
    too_deep: bool = False

    @property
    def over(self) -> bool:
        return self.bytes > self.limit or self.names > MAX_ENTRIES or self.too_deep

    def why(self) -> str:
        """The job's `error` (contract §7 v3: it names the limit)."""
        mb = self.limit // (1024 * 1024)
        if self.too_deep:
            return f"disk limit: the node's folders nest deeper than {MAX_DEPTH} levels"
        if self.names > MAX_ENTRIES:
            return f"disk limit: the node's folders hold more than {MAX_ENTRIES} names"
        return (
            f"disk limit: the node's folders held more than its {mb} MB (TORCHJOBS_JOB_DISK_MAX_MB per GPU)"
        )


def usage(folders: tuple[Path, ...], limit: int) -> Tally:
    """The bytes under `folders` (paths the worker chose), stopping once past `limit`."""
    tally = Tally(limit=limit)
    for folder in folders:
        try:
            fd = open_folder(folder)
        except OSError:  # not made yet, or already gone
            continue
        try:
            _walk(fd, tally, 0)
        finally:
            os.close(fd)
        if tally.over:
            break
    return tally


def _walk(fd: int, tally: Tally, depth: int) -> None:
    if depth > MAX_DEPTH:
        tally.too_deep = True
        return
    try:
        found = entries(fd)
    except OSError:
        return
    for entry in found:
        tally.names += 1
        tally.bytes += max(entry.st.st_blocks * 512, ENTRY_BYTES)
        if tally.over:
            return
        if stat.S_ISDIR(entry.st.st_mode):
            try:
                sub = open_beneath(fd, entry.name, folder=True)
            except OSError:
                continue
            try:
                _walk(sub, tally, depth + 1)
            finally:
                os.close(sub)
            if tally.over:
                return
