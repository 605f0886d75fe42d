from __future__ import annotations

from sqlalchemy.orm import Session

from service.workers import repository as repo
from service.workers.schemas import WorkerList, WorkerOut


def list_workers(session: Session) -> WorkerList:
    allocs = repo.allocations(session)
    used = repo.used_slots(session, allocs)
    jobs: dict[str, set[int]] = {}
    for alloc in allocs:
        jobs.setdefault(alloc.worker_name, set()).add(alloc.job_id)
    return WorkerList(
        items=[
            WorkerOut(
                name=w.name,
                address=w.address,
                accelerator=w.accelerator,
                gpus=w.gpus,
                gpus_free=max(0, w.gpus - len(used.get(w.name, ()))) if w.state == "online" else 0,
                state=w.state,
                last_heartbeat=w.last_heartbeat,
                jobs=sorted(jobs.get(w.name, ())),
            )
            for w in repo.all_workers(session)
        ]
    )
