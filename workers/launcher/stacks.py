"""Every rank's Python stack, taken before a silent job is stopped (contract §8).

A hang is only worth killing once its place is known: which rank waits in which call. The
worker asks `py-spy dump` (a well-kept tool that reads a live interpreter from outside, with no
help from the process). Where py-spy cannot attach, the rank dumps itself: the runtime
registered `faulthandler` on SIGUSR1 (`workers.runtime.stacks`), which writes every thread's
stack to the rank's stderr, that is to its log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from workers.launcher.procs import parent_of

PY_SPY_TIMEOUT_S = 15.0
DUMP_SIGNAL = signal.SIGUSR1  # the runtime's faulthandler listens to it (workers.runtime.stacks)


@dataclass(frozen=True)
class RankStack:
    local_rank: int
    pid: int
    text: str | None  # py-spy's dump; None: the rank was asked to write its own (faulthandler)


def rank_processes(pids: list[int]) -> dict[int, int]:
    """local rank -> the rank's own process among a node's `pids`: the one that has LOCAL_RANK
    while its parent has none (the agent has none; DataLoader workers inherit their rank's)."""
    ranks = {pid: r for pid in pids if (r := _local_rank(pid)) is not None}
    found: dict[int, int] = {}
    for pid in sorted(ranks):
        if parent_of(pid) not in ranks:
            found.setdefault(ranks[pid], pid)
    return found


def _local_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return None
    for var in env:
        if var.startswith(b"LOCAL_RANK="):
            with contextlib.suppress(ValueError):
                return int(var.split(b"=", 1)[1])
    return None


def py_spy() -> str | None:
    """py-spy from the worker's own environment (its wheel puts it beside the interpreter)."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_stack(pid: int, timeout_s: float = PY_SPY_TIMEOUT_S) -> str | None:
    """py-spy's dump of one process (every thread, innermost call last), or None when it
    could not attach: not installed, no ptrace here, the process gone or not Python."""
    tool = py_spy()
    if tool is None:
        return None
    try:
        done = subprocess.run(
            [tool, "dump", "--pid", str(pid)], capture_output=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = done.stdout.decode(errors="replace").strip()
    return text if done.returncode == 0 and text else None


def take_stacks(ranks: dict[int, int]) -> list[RankStack]:
    """Each rank's stack: py-spy's, else the rank is signalled to write its own to its log."""
    stacks = []
    for local_rank, pid in sorted(ranks.items()):
        text = dump_stack(pid)
        if text is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, DUMP_SIGNAL)
        stacks.append(RankStack(local_rank=local_rank, pid=pid, text=text))
    return stacks
