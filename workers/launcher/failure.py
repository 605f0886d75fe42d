"""Naming the root cause of a failed node, and deciding whether a retry could help.

torchrun prints a "Root Cause (first observed failure)" block naming the first rank that
failed; with `@record` that rank also left an error file holding its traceback. Those beat
the knock-on failures of the other ranks.

Classification (on by default; see docs/guide.md, "Failure classification"):
  infrastructure — retried while max_retries allows: a rank killed by a signal nobody asked
  for, a preempted rank (exit 75), a lost or unreachable node, a collective or rendezvous that
  timed out or lost its peer.
  the job's own — never retried, a retry would fail the same way: a Python exception, CUDA
  out of memory, a bad checkpoint or factory, any other non-zero exit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

PREEMPTED_EXIT_CODE = 75
TAIL_LINES = 40
TAIL_BYTES = 8192

_ROOT = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(?P<rank>-?\d+)\s*\(local_rank:\s*(?P<local>\d+)\)"
    r".*?exitcode\s*:\s*(?P<code>-?\d+)",
    re.S,
)
_INFRA_MARKERS = (
    "pre-flight could not",
    "DistNetworkError",
    "RendezvousTimeoutError",
    "RendezvousConnectionError",
    "Connection reset by peer",
    "Connection closed by peer",
    "ProcessGroupNCCL's watchdog",
    "Watchdog caught collective operation timeout",
    "Timed out initializing process group",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "failed to recv, got 0 bytes",
)
_JOB_MARKERS = ("CUDA out of memory", "OutOfMemoryError")


@dataclass(frozen=True, kw_only=True)
class RootCause:
    local_rank: int | None
    rank: int | None
    exit_code: int | None


def root_cause(agent_log: str) -> RootCause:
    match = _ROOT.search(agent_log)
    if match is None:
        return RootCause(local_rank=None, rank=None, exit_code=None)
    return RootCause(local_rank=int(match["local"]), rank=int(match["rank"]), exit_code=int(match["code"]))


def read_error_file(data: bytes) -> str | None:
    """The traceback `@record` wrote, if the failing rank used it (the job wrote this file:
    anything that is not the expected shape is no traceback)."""
    try:
        loaded = json.loads(data) if data else None
    except ValueError:
        return None
    message = loaded.get("message", {}) if isinstance(loaded, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        trace = extra.get("py_callstack") if isinstance(extra, dict) else None
        found = trace or message.get("message")
        return found if isinstance(found, str) else None
    return str(message) if message else None


def tail(data: bytes, lines: int = TAIL_LINES) -> str:
    """The last lines of what a file's end held (read with `JobFolder.read_tail`)."""
    text = data[-TAIL_BYTES:].decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


def is_retryable(exit_code: int | None, text: str, signalled_by_us: bool) -> bool:
    if any(marker in text for marker in _JOB_MARKERS):
        return False
    if exit_code == PREEMPTED_EXIT_CODE and not signalled_by_us:
        return True
    if exit_code is not None and exit_code < 0 and not signalled_by_us:
        return True
    return any(marker in text for marker in _INFRA_MARKERS)
