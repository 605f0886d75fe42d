"""The webhook dispatcher: a thread of the API process (beside the scheduler's) that leases
due deliveries from the outbox and hands each to a small pool of senders.

Every `webhook_poll_s`, or at once when a send finished (the next event of that job may go
now), it leases as many due heads as it has idle senders (`repository.claim_due`: one short
transaction; a compare-and-set on the lease, so several API processes share the outbox). A
lease outlasts any send (`lease_s`): a process that dies mid-send leaves its deliveries to be
leased again when their lease runs out. Nothing here runs in a request or in a scheduler pass.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

from sqlalchemy.exc import OperationalError

from service.config import Settings
from service.db import Database
from service.models import utcnow
from service.webhooks import repository as repo
from service.webhooks.delivery import Clock, Sender, lease_s

log = logging.getLogger("torchjobs.webhooks")


def claim(db: Database, settings: Settings, limit: int, clock: Clock = utcnow) -> list[int]:
    """Lease up to `limit` due heads; a read first, and a write transaction only when something
    is due (an idle outbox costs one indexed read per poll, and no write lock on SQLite)."""
    now = clock()
    with db.read() as session:
        if not repo.any_due(session, now):
            return []
    with db.transaction() as session:
        return repo.claim_due(session, now, limit, now + timedelta(seconds=lease_s(settings)))


class WebhookDispatcher(threading.Thread):
    def __init__(self, db: Database, settings: Settings, sender: Sender | None = None) -> None:
        super().__init__(name="torchjobs-webhooks", daemon=True)
        self.db, self.settings = db, settings
        self.sender = sender or Sender(db, settings)
        self.pool = ThreadPoolExecutor(settings.webhook_concurrency, thread_name_prefix="torchjobs-webhook")
        self._in_flight: set[Future[object]] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                self._lease_and_send()
                self._wake.wait(self.settings.webhook_poll_s)
        finally:
            # sends under way finish and are recorded (each bounded by the timeout); then the
            # client closes
            self.pool.shutdown(wait=True)
            self.sender.close()

    def _lease_and_send(self) -> None:
        with self._lock:
            idle = self.settings.webhook_concurrency - len(self._in_flight)
        if idle <= 0:
            return
        try:
            ids = claim(self.db, self.settings, idle, self.sender.clock)
        except OperationalError as exc:
            log.warning("webhooks: database unreachable (%s)", exc.__class__.__name__)
            return
        except Exception:  # keep dispatching whatever one look hit
            log.exception("webhooks: leasing due deliveries failed")
            return
        for delivery_id in ids:
            future: Future[object] = self.pool.submit(self._deliver, delivery_id)
            with self._lock:
                self._in_flight.add(future)
            future.add_done_callback(self._done)

    def _deliver(self, delivery_id: int) -> None:
        try:
            self.sender.deliver(delivery_id)
        except Exception:  # its lease runs out and it is tried again
            log.exception("webhooks: delivery %s failed unexpectedly", delivery_id)

    def _done(self, future: Future[object]) -> None:
        with self._lock:
            self._in_flight.discard(future)
        self._wake.set()
