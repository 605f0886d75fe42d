"""Sick hosts (contract §8): a host on which attempt after attempt ends in an infrastructure
failure stops taking work until an administrator readmits it.

A node's end says something about its host: an infrastructure failure there (a lost node, a
failed pre-flight, a stall, a GPU error) counts one more in a row; an end that shows the host
working (success, or the job's own error) starts the count again; a cancel or an attempt that
ended elsewhere says nothing. Callers record it in a transaction of its own, after the node's
end: the node's end locks the job, then this the host, and the reaper locks hosts before jobs,
so the two must never share one transaction.

(v3) Not every failure in the row is the host's word. What the job's own code can cause (its
ranks' exit codes and signals, a stall, what they print) counts only once jobs of two or more
owners failed so in the same row: otherwise one user could quarantine any host by killing their
own ranks. What the worker or the scheduler sees for itself counts alone (`counted_failures`).
"""

from __future__ import annotations

import logging
from enum import Enum

from sqlalchemy.orm import Session

from service.errors import NotFound
from service.hosts import repository as repo
from service.models import Job, Worker

log = logging.getLogger("torchjobs.hosts")


# What the runtime's PreflightError says when a check fails (workers/runtime/preflight.py)
PREFLIGHT_FAILED = "pre-flight could not"


class HostVerdict(Enum):
    FAILED_HERE = "failed here"  # an infrastructure failure seen apart from the job's code: alone
    JOB_FAILED_HERE = "job failed here"  # one the job's own code could cause: two owners' count
    WORKED = "worked"  # it ran the code: success, or the job's own error
    NOTHING = "nothing"  # cancelled, or stopped because the attempt ended elsewhere


def failure_verdict(error: str, job: Job | None) -> HostVerdict:
    """Whose word a node's retryable failure is (contract §8, v3). Every such end the worker
    reports comes from the job's ranks (an exit code, a signal, a stall, their output), which
    the job's own code can fake, so it is `JOB_FAILED_HERE`; except a failed pre-flight of ranks
    that run nothing but torchjobs' code (`runs_only_torchjobs_code`): no one else's code can
    have printed it. (The scheduler's lost nodes are `FAILED_HERE` at the reaper.)"""
    if PREFLIGHT_FAILED in error and job is not None and runs_only_torchjobs_code(job):
        return HostVerdict.FAILED_HERE
    return HostVerdict.JOB_FAILED_HERE


def runs_only_torchjobs_code(job: Job) -> bool:
    """A builtin model and data set, no uploaded code, no pip packages: the ranks import nothing
    of the user's (the spec refuses PYTHONPATH and the like in `env`), so what they print is
    torchjobs' own. A factory, a script, a code archive or a package could print anything."""
    return (
        job.entrypoint.get("kind") == "builtin"
        and job.code is None
        and not (job.environment or {}).get("pip")
        and not job.env  # GLOO_SOCKET_IFNAME=nosuch fails a pre-flight by the user's own choice
    )


def record_node_end(
    session: Session,
    worker_name: str,
    verdict: HostVerdict,
    detail: str,
    quarantine_after: int,
    owner: int | None = None,
) -> bool:
    """Count the end against the host (`owner`: the user whose job failed, for a
    `JOB_FAILED_HERE`); True when this end put it in quarantine."""
    if verdict is HostVerdict.NOTHING:
        return False
    if verdict is HostVerdict.WORKED:
        repo.reset_failures(session, worker_name)
        return False
    worker = repo.lock_worker(session, worker_name)
    if worker is None:
        return False
    _count_failure(worker, verdict, owner)
    if not quarantine_after or counted_failures(worker) < quarantine_after or worker.quarantine_reason:
        return False
    worker.quarantine_reason = _reason(worker, detail)
    log.warning("worker %s quarantined: %s", worker_name, worker.quarantine_reason)
    return True


def _count_failure(worker: Worker, verdict: HostVerdict, owner: int | None) -> None:
    """One more failure in the row; a job-caused one also notes its job's owner (two ids are
    enough to know that two owners failed here, so no more are kept)."""
    worker.infra_failures += 1
    if verdict is not HostVerdict.JOB_FAILED_HERE:
        return
    worker.job_failures += 1
    owners = list(worker.job_failure_owners or [])
    if owner is not None and owner not in owners and len(owners) < 2:
        worker.job_failure_owners = [*owners, owner]  # a new list: the ORM sees no in-place change


def counted_failures(worker: Worker) -> int:
    """The row's failures that count towards quarantine (contract §8, v3): those seen apart from
    the jobs' code always; the job-caused ones only once jobs of two different owners failed so
    in this row, so that no single user can make a host look sick."""
    alone = worker.infra_failures - worker.job_failures
    return alone + (worker.job_failures if _two_owners(worker) else 0)


def _two_owners(worker: Worker) -> bool:
    return len(worker.job_failure_owners or []) >= 2


def _reason(worker: Worker, detail: str) -> str:
    """The count and the last failure; how many of them the jobs' own code could have caused,
    and whether they counted, so that the admin can tell a sick host from a run of bad jobs."""
    told = ""
    if worker.job_failures:
        whose = "jobs of two or more owners" if _two_owners(worker) else "one owner's jobs: not counted"
        told = f" ({worker.job_failures} of them of a kind a job can cause, by {whose})"
    return (
        f"{worker.infra_failures} attempts in a row ended in an infrastructure failure on this host"
        f"{told}; the last: {_gist(detail)}"
    )[:512]


def readmit(session: Session, worker_name: str) -> Worker:
    """The administrator's word that the host is well again: it takes work, its count starts over."""
    worker = repo.lock_worker(session, worker_name)
    if worker is None:
        raise NotFound(f"worker {worker_name!r}")  # "worker 'x' not found"
    if worker.quarantine_reason is not None:
        log.info("worker %s readmitted (was: %s)", worker_name, worker.quarantine_reason)
    worker.quarantine_reason, worker.infra_failures = None, 0
    worker.job_failures, worker.job_failure_owners = 0, None
    worker.draining_since = None  # a drain ends too (contract §12)
    return worker


def _gist(text: str) -> str:
    """Where it failed (the first line) and what the error said (the last: a trace's message)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return text[:300]
    return lines[0][:150] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else "")
