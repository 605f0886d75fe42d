from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from service.errors import NotFound
from service.hosts import health
from service.hosts import repository as repo
from service.hosts.schemas import WorkerList, WorkerOut
from service.models import User, Worker, utcnow
from service.states import WorkerState

log = logging.getLogger("torchjobs.hosts")
PUBLIC_REASON = "attempts in a row ended in an infrastructure failure on this host (the admin sees which)"


def list_workers(session: Session, caller: User | None) -> WorkerList:
    """Every worker; the job ids on them only the caller's own (all of them for the admin, and
    for the service itself, `None`: the metrics): another user's GPUs count as busy, nothing
    more (contract §7)."""
    allocs = repo.allocations(session)
    used = repo.used_slots(session, allocs)
    visible = None
    if caller is not None and not caller.is_admin:
        visible = repo.jobs_owned_by(session, caller.id, {a.job_id for a in allocs})
    jobs: dict[str, set[int]] = {}
    for alloc in allocs:
        if visible is None or alloc.job_id in visible:
            jobs.setdefault(alloc.worker_name, set()).add(alloc.job_id)
    return WorkerList(
        items=[
            worker_out(w, used.get(w.name, set()), sorted(jobs.get(w.name, ())), visible is None)
            for w in repo.all_workers(session)
        ]
    )


def worker_out(w: Worker, used: set[int], jobs: list[int], full_reason: bool = True) -> WorkerOut:
    """A quarantined host is online but takes no new work: it shows no free GPUs (contract §8).
    Its reason quotes the failure of someone's job: whole for the admin, its count for others."""
    takes_work = w.state == WorkerState.ONLINE and w.quarantine_reason is None and w.draining_since is None
    quarantined = w.state == WorkerState.ONLINE and w.quarantine_reason is not None
    state = "quarantined" if quarantined else w.state
    if w.draining_since is not None and w.state == WorkerState.ONLINE:  # contract §12
        state = "draining" if used else "drained"
    return WorkerOut(
        name=w.name,
        address=w.address,
        accelerator=w.accelerator,
        gpus=w.gpus,
        gpu_ids=list(w.gpu_ids or [str(i) for i in range(w.gpus)]),
        gpus_free=max(0, w.gpus - len(used)) if takes_work else 0,
        state=state,
        reason=w.quarantine_reason if full_reason or w.quarantine_reason is None else PUBLIC_REASON,
        infra_failures=w.infra_failures,
        last_heartbeat=w.last_heartbeat,
        started_at=w.started_at,
        jobs=jobs,
        isolation=w.isolation,
        isolation_detail=w.isolation_detail,
        open_to_all=w.open_to_all,
        multinode_open_to_all=w.multinode_open_to_all,
    )


def readmit_worker(session: Session, name: str) -> WorkerOut:
    worker = health.readmit(session, name)
    session.flush()
    held = [a for a in repo.allocations(session) if a.worker_name == name]
    return worker_out(worker, {a.gpu_index for a in held}, sorted({a.job_id for a in held}))


def drain_worker(session: Session, name: str) -> WorkerOut:
    """Nothing new is placed on the host; the scheduler's next pass stops every job with a node
    there as if preempted (contract §12). Repeated: the same drain, still going."""
    worker = repo.lock_worker(session, name)
    if worker is None:
        raise NotFound(f"worker {name!r}")
    if worker.draining_since is None:
        worker.draining_since = utcnow()
        log.info("worker %s: drain asked", name)
    session.flush()
    held = [a for a in repo.allocations(session) if a.worker_name == name]
    return worker_out(worker, {a.gpu_index for a in held}, sorted({a.job_id for a in held}))
