from __future__ import annotations

from sqlalchemy.orm import Session

from service.hosts import repository as repo
from service.hosts.schemas import WorkerList, WorkerOut
from service.models import User
from service.states import WorkerState


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
            WorkerOut(
                name=w.name,
                address=w.address,
                accelerator=w.accelerator,
                gpus=w.gpus,
                gpu_ids=list(w.gpu_ids or [str(i) for i in range(w.gpus)]),
                gpus_free=max(0, w.gpus - len(used.get(w.name, ()))) if w.state == WorkerState.ONLINE else 0,
                state=w.state,
                last_heartbeat=w.last_heartbeat,
                started_at=w.started_at,
                jobs=sorted(jobs.get(w.name, ())),
                isolation=w.isolation,
                isolation_detail=w.isolation_detail,
                open_to_all=w.open_to_all,
            )
            for w in repo.all_workers(session)
        ]
    )
