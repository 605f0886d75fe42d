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


def pids_under(run_prefix: str) -> list[int]:
    """Processes whose TORCHJOBS_CHECKPOINT_DIR lies under `run_prefix` (never this process)."""
    needle = ENV_KEY + run_prefix.encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if any(var.startswith(needle) for var in env.split(b"\0")):
            found.append(int(entry))
    return found


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_under(run_prefix: str) -> int:
    """SIGKILL everything left of a node (or of every node under a worker's run folder)."""
    pids = pids_under(run_prefix)
    signal_all(pids, signal.SIGKILL)
    return len(pids)
