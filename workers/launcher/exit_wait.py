"""Sleep until a child process exits or a timeout passes, in one system call.

`Popen.wait(timeout)` polls `waitpid` with sleeps that double up to 50 ms: a supervisor that
waits a quarter second at a time wakes about forty times a second for as long as the job runs,
on the very cores the job trains on (the worker's largest CPU cost while a job trains here).
A pidfd (Linux 5.3+) becomes readable when the process exits, so `select` on it sleeps until
exactly then (`poll`, not `select`: a busy worker's descriptors pass 1023, where `select`
raises). Where pidfds are missing, it falls back to `Popen.wait`.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess


class ExitWait:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self._fd: int | None = None
        self._poller = select.poll()
        with contextlib.suppress(AttributeError, OSError):  # no pidfd_open: old kernel or Python
            self._fd = os.pidfd_open(proc.pid)
            self._poller.register(self._fd, select.POLLIN)

    def wait(self, timeout: float) -> int | None:
        """The exit status once the process has exited, else None after `timeout` seconds."""
        if self._fd is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self.proc.wait(timeout=max(timeout, 0.0))
            return None
        with contextlib.suppress(InterruptedError):
            self._poller.poll(max(timeout, 0.0) * 1000)
        return self.proc.poll()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ExitWait:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
