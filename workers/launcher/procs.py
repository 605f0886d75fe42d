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


def kill_group(pgid: int, sig: signal.Signals) -> None:
    """A signal to a whole process group (an agent and what it started), if it is still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_under(run_prefix: str) -> int:
    """SIGKILL everything left of a node (or of every node under a worker's run folder)."""
    pids = pids_under(run_prefix)
    signal_all(pids, signal.SIGKILL)
    return len(pids)
