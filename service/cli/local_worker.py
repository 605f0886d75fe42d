"""`torchjobs up`'s local worker, started again if it dies while `up` runs.

On one machine with nothing installed, that worker is the only one: if it crashed (the OOM
killer, a bug) and stayed down, every job after it would wait in the queue for ever while the
API kept answering. A worker that exits with an error or is killed is started again; one that
exits 0 was asked to stop (a Ctrl-C in the terminal reaches it too) and is left stopped. Its
jobs are handled like those of any lost worker (retried from their last checkpoint); the
keeper only brings a worker back, waiting longer after each quick death so that a worker
which cannot start does not spin.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from service.parent_death import dying_with_parent

log = logging.getLogger("torchjobs")
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0  # a worker that lived this long starts the backoff over


class LocalWorkerKeeper:
    def __init__(self, cmd: Sequence[str], stop_wait_s: float, log_file: Path | None = None) -> None:
        """`log_file`: the worker's output is appended there, not to `up`'s terminal."""
        self.cmd, self.stop_wait_s, self.log_file = list(cmd), stop_wait_s, log_file
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._started = threading.Event()
        # The worker gets SIGTERM if the thread that started it ends (parent_death.py): this
        # thread, which lives exactly as long as `up`.
        self._thread = threading.Thread(target=self._keep, name="torchjobs-local-worker", daemon=True)

    def start(self) -> LocalWorkerKeeper:
        self._thread.start()
        self._started.wait()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _keep(self) -> None:
        backoff = FIRST_BACKOFF_S
        while True:
            started = time.monotonic()
            self._proc = self._spawn()
            self._started.set()
            while self._proc.poll() is None and not self._stopping.wait(0.2):
                pass
            if self._stopping.is_set():
                _stop_child(self._proc, self.stop_wait_s)
                return
            if self._proc.returncode == 0:  # it was asked to stop (Ctrl-C reaches it too): let it be
                log.warning("the local worker stopped; `up` now runs without one")
                return
            if time.monotonic() - started >= HEALTHY_AFTER_S:
                backoff = FIRST_BACKOFF_S
            log.error(
                "the local worker exited (code %s); starting it again in %.0f s",
                self._proc.returncode,
                backoff,
            )
            if self._stopping.wait(backoff):
                return
            backoff = min(MAX_BACKOFF_S, backoff * 2)

    def _spawn(self) -> subprocess.Popen[bytes]:
        if self.log_file is None:
            return subprocess.Popen(dying_with_parent(self.cmd), env=os.environ.copy())
        self.log_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                dying_with_parent(self.cmd), env=os.environ.copy(), stdout=out, stderr=subprocess.STDOUT
            )


def _stop_child(proc: subprocess.Popen[bytes], wait_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
