"""Each job node in a control group of its own: its limits, and a way to end all of it.

Contract §7 v3: a node runs under a process limit and a memory limit (shared memory included:
the kernel charges tmpfs pages to the cgroup that wrote them), and past one the job fails with
an `error` naming the limit. The same group is how nothing of a node outlives it: the worker
kills every process in it at the node's end, and a worker that starts kills every process left
in its predecessor's groups, whatever happened to the sandbox's bwrap or to PDEATHSIG.

cgroup v1 (separate `pids` and `memory` hierarchies, as on this project's CI machine) and v2
(one unified hierarchy, the controllers enabled in the parent's `cgroup.subtree_control`) are
both handled; a host where neither is writable runs nodes without groups, and says so at start.
Groups live under `torchjobs/<worker name>-<digest of its run folder>/`, so two workers on one
host never touch each other's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("torchjobs.worker")
ROOT = Path("/sys/fs/cgroup")

# The first program in a node's process tree: moves itself into the node's groups, then execs.
# Everything it starts is born inside (no race with a fork, no preexec_fn in a threaded worker).
_JOIN = (
    "import os, sys\n"
    "n = int(sys.argv[1])\n"
    "for path in sys.argv[2:2 + n]:\n"
    "    with open(path, 'w') as fh: fh.write('0')\n"
    "os.execvp(sys.argv[2 + n], sys.argv[2 + n:])\n"
)


@dataclass(frozen=True)
class Hierarchy:
    """Where groups are made: v1 has one folder per controller, v2 one for all."""

    folders: tuple[Path, ...]  # the worker's base folder in each hierarchy
    v2: bool

    def group(self, name: str) -> tuple[Path, ...]:
        return tuple(folder / name for folder in self.folders)


def detect(worker: str, run_root: Path, root: Path = ROOT) -> Hierarchy | None:
    """The hierarchies this worker may make groups in, tried for real (a folder made and
    removed); None where it may not (not root, a read-only /sys, no controllers).

    The folder is named by the worker's name and its run folder: a worker that starts again
    finds exactly what its previous process left, and no other installation's on the host."""
    digest = hashlib.sha256(str(run_root).encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in worker)[:64] + f"-{digest}"
    if (root / "pids").is_dir() and (root / "memory").is_dir():
        hierarchy = Hierarchy(
            (root / "pids" / "torchjobs" / safe, root / "memory" / "torchjobs" / safe), False
        )
    elif (root / "cgroup.controllers").exists():
        hierarchy = Hierarchy((root / "torchjobs" / safe,), True)
    else:
        return None
    try:
        for folder in hierarchy.folders:
            folder.mkdir(parents=True, exist_ok=True)
        if hierarchy.v2:
            _enable_v2_controllers(root, hierarchy.folders[0])
        probe = NodeGroup.make(hierarchy, "probe", pids_max=64, memory_bytes=None)
        probe.remove()
    except OSError as exc:
        log.warning("no control groups for job nodes (%s): nodes run without process and memory limits", exc)
        return None
    return hierarchy


def _enable_v2_controllers(root: Path, base: Path) -> None:
    for folder in (root, *reversed(base.relative_to(root).parents[:-1])):
        target = folder if folder == root else root / folder
        (target / "cgroup.subtree_control").write_text("+pids +memory")
    for folder in (base.parent, base):
        (folder / "cgroup.subtree_control").write_text("+pids +memory")


@dataclass(frozen=True)
class NodeGroup:
    """One node's groups (a folder per hierarchy)."""

    folders: tuple[Path, ...]
    v2: bool
    pids_max: int
    memory_bytes: int | None

    @classmethod
    def make(cls, hierarchy: Hierarchy, name: str, pids_max: int, memory_bytes: int | None) -> NodeGroup:
        group = cls(hierarchy.group(name), hierarchy.v2, pids_max, memory_bytes)
        for folder in group.folders:
            folder.mkdir(exist_ok=True)
        pids, memory = group._pids_folder(), group._memory_folder()
        (pids / "pids.max").write_text(str(pids_max))
        if memory_bytes is not None:
            limit = "memory.max" if hierarchy.v2 else "memory.limit_in_bytes"
            (memory / limit).write_text(str(memory_bytes))
            if not hierarchy.v2:
                with contextlib.suppress(OSError):  # no swap accounting: swap is not counted
                    (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        return group

    def _pids_folder(self) -> Path:
        return self.folders[0]

    def _memory_folder(self) -> Path:
        return self.folders[0] if self.v2 else self.folders[1]

    def join_argv(self, argv: list[str]) -> list[str]:
        """`argv`, started inside the node's groups."""
        procs = [str(folder / "cgroup.procs") for folder in self.folders]
        return [sys.executable, "-S", "-I", "-c", _JOIN, str(len(procs)), *procs, *argv]

    def add(self, pids: list[int]) -> None:
        """Move running processes in (a warm agent's sandbox, started before its job was known)."""
        for folder in self.folders:
            for pid in pids:
                with contextlib.suppress(OSError):  # gone meanwhile
                    (folder / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """The live processes in the groups (a zombie stays listed until its parent reaps it,
        and is nothing to kill: the agent's bwrap, killed and not yet waited for, is one)."""
        found: set[int] = set()
        for folder in self.folders:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (folder / "cgroup.procs").read_text().split())
        return sorted(pid for pid in found if not _dead(pid))

    def passed(self) -> str | None:
        """The limit the node ran into, as the job's `error` names it; None for neither."""
        if _count(self._pids_folder() / "pids.events", "max"):
            return (
                f"process limit: the node's processes and threads reached {self.pids_max} "
                "(TORCHJOBS_JOB_PIDS_MAX)"
            )
        if self.memory_bytes is not None and self._oom_kills():
            mb = self.memory_bytes // (1024 * 1024)
            return (
                f"memory limit: the node used its {mb} MB, shared memory included, and the kernel "
                "killed a process (TORCHJOBS_MEMORY_PER_GPU_MB per GPU)"
            )
        return None

    def _oom_kills(self) -> int:
        memory = self._memory_folder()
        if self.v2:
            return _count(memory / "memory.events", "oom_kill")
        return _count(memory / "memory.oom_control", "oom_kill")

    def kill_all(self, patience_s: float = 10.0) -> int:
        """SIGKILL until the groups are empty (a fork between a read and the kill is caught by
        the next round). Returns how many were killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + patience_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.05)
        return len(killed)

    def remove(self) -> None:
        """The empty groups; one that still holds a process (a zombie not yet reaped) stays,
        for the next start's sweep."""
        for folder in self.folders:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")


def host_memory() -> int:
    """This host's memory in bytes: the default memory limit is its share per GPU slot."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _count(path: Path, key: str) -> int:
    """A counter from a cgroup file of `key value` lines."""
    try:
        text = path.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def leftovers(hierarchy: Hierarchy) -> Iterator[NodeGroup]:
    names = {
        child.name
        for folder in hierarchy.folders
        if folder.is_dir()
        for child in folder.iterdir()
        if child.is_dir()
    }
    for name in sorted(names):
        yield NodeGroup(hierarchy.group(name), hierarchy.v2, 0, None)


def sweep(hierarchy: Hierarchy) -> int:
    """At a worker's start: every process its previous run left in a node's groups is killed
    (the sandbox must die with the worker, whatever killed the worker), the groups removed."""
    killed = 0
    for group in leftovers(hierarchy):
        killed += group.kill_all()
        group.remove()
    return killed
