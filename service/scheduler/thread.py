"""The scheduler's thread: a pass (`service.scheduler.placement_pass.run_pass`) every
`scheduler_interval_s`, or at once when woken; every `scheduler_idle_interval_s` when nothing
waits; after each pass, a rest twice as long as it took (at most a second). Every API replica
runs one; which of them places is the pass's own business (its advisory lock: one pass at a
time).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.exc import OperationalError

from service.config import Settings
from service.db import Database
from service.jobs import repository as jobs_repo
from service.jobs.queue_counts import recount_queue
from service.jobs.states import CANCELLING, QUEUED
from service.scheduler.outages import DatabaseOutages
from service.scheduler.placement_pass import Dispatcher, ResendThrottle, Room, run_pass

log = logging.getLogger("torchjobs.scheduler")


REST_PER_PASS = 2.0
MAX_REST_S = 1.0


class SchedulerThread(threading.Thread):
    """Runs passes every `scheduler_interval_s`, or at once when `wake()` is called."""

    def __init__(self, db: Database, settings: Settings, dispatch: Dispatcher) -> None:
        super().__init__(name="torchjobs-scheduler", daemon=True)
        self.db, self.settings, self.dispatch = db, settings, dispatch
        self.throttle = ResendThrottle(settings.redispatch_after_s)
        self.outages = DatabaseOutages(settings.heartbeat_timeout_s)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.room = Room()
        self.observe_pass: Callable[[float], None] = lambda _seconds: None  # the app's histogram
        self._recounted_at = time.monotonic()

    def wake(self) -> None:
        self._wake.set()

    def wake_for_submit(self) -> None:
        """A pass now for a new job, unless the last one left no GPU free: against a full
        cluster a flood of submits would each buy a pass over the whole queue that places
        nothing (measured: a fifth of the server's CPU per `POST /v1/jobs` with 3,000 jobs
        queued). The timed pass, `scheduler_interval_s` later, gives the job its reason; a
        freed GPU, a new host or a cancel wakes the scheduler as before."""
        if self.room.gpu_free:
            self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        while not self._stopping.is_set():
            pause = self.settings.scheduler_interval_s
            took = 0.0
            try:
                started = time.perf_counter()
                run_pass(self.db, self.settings, self.dispatch, self.throttle, self.outages, self.room)
                took = time.perf_counter() - started
                self.observe_pass(took)
                if not has_waiting_work(self.db):
                    pause = max(pause, self.settings.scheduler_idle_interval_s)
                self._recount_when_due()
            except OperationalError as exc:  # the database away (has_waiting_work; run_pass catches its own)
                self.outages.unreachable()
                log.warning("scheduler: database unreachable (%s)", exc.__class__.__name__)
            except Exception:  # keep scheduling whatever one pass hit
                log.exception("scheduler pass failed")
            # Rest twice as long as the pass took before a wake may start the next: a stream
            # of submits against a long queue (each one a wake, each pass reading the whole
            # queue) then costs at most a third of the process's CPU, not all of it, and a
            # short queue's pass (milliseconds) is as prompt as before.
            self._stopping.wait(min(REST_PER_PASS * took, MAX_REST_S))
            self._wake.wait(pause)
            self._wake.clear()

    def _recount_when_due(self) -> None:
        """The queue's counts checked against the queue now and then: positions stay right
        even after a write that bypassed the gate (service.jobs.queue_counts.recount_queue)."""
        every = self.settings.queue_recount_s
        if not every or time.monotonic() - self._recounted_at < every:
            return
        self._recounted_at = time.monotonic()
        with self.db.transaction() as session:
            corrections = recount_queue(session)
        if corrections:
            log.warning("queue counts had drifted from the queue, corrected: %s", corrections)


def has_waiting_work(db: Database) -> bool:
    """Whether the next timed pass may have something to do besides noticing a lost worker: a
    job queued (capacity may free), cancelling (its pending nodes to close), or a node placed
    and not yet claimed (to re-send). A submit or freed GPUs wake the scheduler anyway."""
    with db.read() as session:
        job = jobs_repo.any_job_in(session, (QUEUED, CANCELLING))
        if not job:  # a sweep whose children all ended since the last pass: settle it
            job = jobs_repo.any_running_sweep(session)
        node = jobs_repo.any_pending_node(session)
    return job or node


__all__ = ["SchedulerThread"]
