"""Finding a node's processes wherever torchrun put them.

torchrun starts every rank in a session of its own (`start_new_session=True` in its
SubprocessHandler), so a signal to the agent's process group never reaches the ranks, and a
rank whose agent died is re-parented to init. What every rank and every DataLoader worker it
forks does carry is its environment: `TORCHJOBS_CHECKPOINT_DIR` names the node's own run
folder. Scanning /proc for it finds them all, orphans included.
"""

from __future__ import annotations

import contextlib
import os
import signal

ENV_KEY = b"TORCHJOBS_CHECKPOINT_DIR="
WARM_AGENT_MARKER = b"workers.launcher.warm_agent"


def pids_under(run_prefix: str) -> list[int]:
    """Processes whose TORCHJOBS_CHECKPOINT_DIR lies under `run_prefix` (never this process),
    and warm torchrun agents working in a folder under it (a warm agent took the launch's
    environment after it started, so /proc shows it its old one; its folder is the launch's)."""
    needle = ENV_KEY + run_prefix.encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        if _has_env(entry, needle) or _is_warm_agent_under(entry, run_prefix):
            found.append(int(entry))
    return found


def _has_env(pid: str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read()
    except OSError:
        return False
    return any(var.startswith(needle) for var in env.split(b"\0"))


def _is_warm_agent_under(pid: str, run_prefix: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if WARM_AGENT_MARKER not in fh.read():
                return False
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return (cwd + "/").startswith(run_prefix)


def sandbox_namespace(outer_pid: int) -> str | None:
    """The PID namespace of a sandbox, found from bwrap's outer process (our child): its child
    there lives in a namespace that is not ours. None until that child exists (or once all of
    it ended). Inside, every rank has the same TORCHJOBS_CHECKPOINT_DIR (/job/...), so the
    namespace, not the environment, tells one node's processes from another's."""
    pinned = pin_sandbox_namespace(outer_pid)
    if pinned is None:
        return None
    os.close(pinned[1])
    return pinned[0]


def pin_sandbox_namespace(outer_pid: int) -> tuple[str, int] | None:
    """`sandbox_namespace`, with a descriptor of that namespace held open: (its name, the
    descriptor, which the caller closes once it no longer names the node's processes by it).

    A namespace's name is its inode number, and the kernel gives a freed number to the next
    namespace made (the lowest free one): once a node's sandbox has emptied, another sandbox
    on the host (another worker's node, a warm spare) may be made under the very same name,
    and a stop that signals every process "of the namespace" would SIGKILL that one. While a
    descriptor of it is open the namespace is not freed (it stays, empty), so its name cannot
    be given to another one."""
    mine = pid_namespace("self")
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or parent_of(entry) != outer_pid:
            continue
        try:
            fd = os.open(f"/proc/{entry}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # it ended meanwhile
            continue
        ns = f"pid:[{os.fstat(fd).st_ino}]"
        if ns != mine and parent_of(entry) == outer_pid:  # still bwrap's child: that namespace
            return ns, fd
        os.close(fd)
    return None


def pids_in_namespace(ns: str) -> list[int]:
    """Every process of one sandbox, its PID 1 (sandbox.ENTRY, torchrun's parent) first:
    killing that one with SIGKILL makes the kernel kill all the others."""
    found = [int(e) for e in os.listdir("/proc") if e.isdigit() and pid_namespace(e) == ns and not _zombie(e)]
    return sorted(found, key=lambda pid: (_namespace_pid(pid) != 1, pid))


def _stat(pid: str) -> list[bytes]:
    """/proc/PID/stat's fields after the command name (state, ppid, …); [] when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _zombie(pid: str) -> bool:
    """Dead and not yet reaped: nothing left to signal."""
    fields = _stat(pid)
    return not fields or fields[0] in (b"Z", b"X")


def pid_namespace(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def parent_of(pid: int | str) -> int | None:
    fields = _stat(str(pid))
    return int(fields[1]) if len(fields) > 1 else None


def _namespace_pid(pid: int) -> int | None:
    """The process's PID inside its own namespace (the last NSpid of its status)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def kill_group(pgid: int, sig: signal.Signals) -> None:
    """A signal to a whole process group (an agent and what it started), if it is still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def sandbox_run_dirs() -> dict[str, tuple[int, str]]:
    """PID namespace -> (bwrap's outer pid, the host run folder bound at /job), for every node
    sandbox on this machine: a sandbox's ranks name /job in their environment, so a worker
    that restarts finds its predecessor's by bwrap's command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if not argv[0].endswith(b"bwrap") or b"/job" not in argv:
            continue
        ns = sandbox_namespace(int(entry))
        if ns is not None:
            found[ns] = (int(entry), argv[argv.index(b"/job") - 1].decode(errors="replace") + "/")
    return found


def kill_under(run_prefix: str) -> int:
    """SIGKILL everything left of a node (or of every node under a worker's run folder),
    sandboxed or not."""
    pids = pids_under(run_prefix)
    for ns, (outer, run_dir) in sandbox_run_dirs().items():
        if run_dir.startswith(run_prefix):
            pids += [outer, *pids_in_namespace(ns)]
    signal_all(pids, signal.SIGKILL)
    return len(pids)
