"""A rank can be asked for its own stack: the worker's fallback when py-spy cannot attach.

`faulthandler` writes every thread's Python stack to stderr (the rank's log) on SIGUSR1,
from a C signal handler: it works while the rank is blocked in a collective or a sleep, where
a Python-level handler would never run. See `workers.launcher.stacks`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys


def allow_stack_dumps() -> None:
    """Register the dump on SIGUSR1; a process whose stderr is not a real file skips it."""
    with contextlib.suppress(AttributeError, ValueError, OSError, RuntimeError):
        sys.stderr.write("")
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
