"""SIGTERM as a request to stop: remember it, let the trainer act at the next step boundary.

The handler only sets a flag (nothing else is safe inside a signal handler); the trainer agrees
with the other ranks on when to stop, saves, and exits with PREEMPTED_EXIT_CODE. torchrun
forwards its own SIGTERM to the ranks and waits 30 s before SIGKILL; a repeated SIGTERM is
harmless. `ParentWatchdog` covers the case where torchrun cannot forward anything: it was killed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from workers.runtime.errors import PREEMPTED_EXIT_CODE


class PreemptionFlag:
    """Set once SIGTERM arrives."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> PreemptionFlag:
        """Handle SIGTERM from now on (only the main thread may install handlers)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, _signum: int, _frame: FrameType | None) -> None:
        self.requested = True


class ParentWatchdog:
    """Stops a rank whose torchrun has died, instead of leaving it running for nobody.

    torchrun starts every rank in a session of its own, so a signal to torchrun's process group
    never reaches the ranks: if torchrun is killed outright (SIGKILL, OOM killer), its ranks live
    on as orphans. This thread notices the parent change, asks the trainer to stop as after a
    SIGTERM (save, exit 75), and exits the process hard after `grace_s` in case the main thread is
    stuck where it cannot see the flag (e.g. a DataLoader waiting for a batch that will never come
    because the job's folders were removed under it).
    """

    def __init__(
        self,
        flag: PreemptionFlag,
        *,
        grace_s: float = 30.0,
        poll_s: float = 1.0,
        getppid: Callable[[], int] = os.getppid,
        hard_exit: Callable[[int], None] = os._exit,
    ) -> None:
        self._flag = flag
        self._grace_s = grace_s
        self._poll_s = poll_s
        self._getppid = getppid
        self._hard_exit = hard_exit
        self._parent = getppid()

    def start(self) -> ParentWatchdog:
        threading.Thread(target=self._watch, name="torchjobs-parent-watchdog", daemon=True).start()
        return self

    def _watch(self) -> None:
        while self._getppid() == self._parent:
            time.sleep(self._poll_s)
        message = f"torchrun (pid {self._parent}) is gone: stopping, exiting in {self._grace_s:g} s at most"
        print(f"[torchjobs] {message}", file=sys.stderr, flush=True)
        self._flag.requested = True
        time.sleep(self._grace_s)
        self._hard_exit(PREEMPTED_EXIT_CODE)
