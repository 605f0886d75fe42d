"""Sick hosts (contract §8): a host on which attempt after attempt ends in an infrastructure
failure stops taking work until an administrator readmits it.

A node's end says something about its host: an infrastructure failure there (a lost node, a
failed pre-flight, a stall, a GPU error) counts one more in a row; an end that shows the host
working (success, or the job's own error) starts the count again; a cancel or an attempt that
ended elsewhere says nothing. Callers record it in a transaction of its own, after the node's
end: the node's end locks the job, then this the host, and the reaper locks hosts before jobs,
so the two must never share one transaction.
"""

from __future__ import annotations

import logging
from enum import Enum

from sqlalchemy import update
from sqlalchemy.orm import Session

from service.errors import NotFound
from service.models import Worker

log = logging.getLogger("torchjobs.hosts")


class HostVerdict(Enum):
    FAILED_HERE = "failed here"  # an infrastructure failure on this host
    WORKED = "worked"  # it ran the code: success, or the job's own error
    NOTHING = "nothing"  # cancelled, or stopped because the attempt ended elsewhere


def record_node_end(
    session: Session, worker_name: str, verdict: HostVerdict, detail: str, quarantine_after: int
) -> bool:
    """Count the end against the host; True when this end put it in quarantine."""
    if verdict is HostVerdict.NOTHING:
        return False
    if verdict is HostVerdict.WORKED:
        session.execute(
            update(Worker)
            .where(Worker.name == worker_name, Worker.infra_failures != 0)
            .values(infra_failures=0)
        )
        return False
    worker = session.get(Worker, worker_name, with_for_update=True)
    if worker is None:
        return False
    worker.infra_failures += 1
    if not quarantine_after or worker.infra_failures < quarantine_after or worker.quarantine_reason:
        return False
    worker.quarantine_reason = (
        f"{worker.infra_failures} attempts in a row ended in an infrastructure failure on this host; "
        f"the last: {_gist(detail)}"
    )[:512]
    log.warning("worker %s quarantined: %s", worker_name, worker.quarantine_reason)
    return True


def readmit(session: Session, worker_name: str) -> Worker:
    """The administrator's word that the host is well again: it takes work, its count starts over."""
    worker = session.get(Worker, worker_name, with_for_update=True)
    if worker is None:
        raise NotFound(f"worker {worker_name!r}")  # "worker 'x' not found"
    if worker.quarantine_reason is not None:
        log.info("worker %s readmitted (was: %s)", worker_name, worker.quarantine_reason)
    worker.quarantine_reason, worker.infra_failures = None, 0
    return worker


def _gist(text: str) -> str:
    """Where it failed (the first line) and what the error said (the last: a trace's message)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return text[:300]
    return lines[0][:150] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else "")
