"""The scheduler pass's stops (contract §12): the running jobs preemption may choose from,
the preemptions a plan decided, and the jobs on hosts being drained. In the pass's
transaction: a victim is marked stopping in the same commit that decides it, so no later
pass preempts again for the same job, and its GPUs stay its own until its nodes have ended.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from service.hosts import repository as hosts_repo
from service.jobs import repository as jobs_repo
from service.jobs.preemption import request_stop
from service.jobs.states import CANCELLING, RUNNING, SCHEDULED, lock_job
from service.scheduler.preemption import RunningJob

log = logging.getLogger("torchjobs.scheduler")


def running_jobs(session: Session, top_queued: int | None) -> list[RunningJob]:
    """Every job holding GPUs, when preemption could matter: some queued job outranks a
    preemptible running one, or jobs are being stopped for a queued one. Else none (no reads
    of every allocation in a pass that could not preempt)."""
    if top_queued is None:
        return []
    low = hosts_repo.lowest_preemptible_priority(session, (RUNNING,))
    if (low is None or low >= top_queued) and not hosts_repo.any_preempting(session):
        return []
    slots: dict[int, dict[str, int]] = {}
    for job_id, host, n in hosts_repo.held_by_jobs(session):
        slots.setdefault(job_id, {})[host] = n
    out = []
    for job_id, priority, owner, started, preemptible, state, stopping_since, for_job in hosts_repo.job_facts(
        session, set(slots)
    ):
        stopping = stopping_since is not None
        out.append(
            RunningJob(
                id=job_id,
                priority=priority,
                owner=owner,
                started=started.timestamp() if started is not None else float("inf"),
                preemptible=bool(preemptible) and state == RUNNING,  # a scheduled job: next pass
                slots=slots[job_id],
                stopping=stopping or state == CANCELLING,
                for_job=for_job if stopping else None,
            )
        )
    return out


def preempt(session: Session, preemptions: dict[int, tuple[int, ...]]) -> None:
    """Stop the victims the plan chose, each for its preemptor (an event on each victim)."""
    for preemptor_id, victims in preemptions.items():
        preemptor = lock_job(session, preemptor_id)
        if preemptor is None:
            continue
        for victim_id in victims:
            victim = lock_job(session, victim_id)
            if (
                victim is not None
                and victim.state == RUNNING
                and request_stop(session, victim, by_job=preemptor)
            ):
                log.info("job %s preempted for job %s", victim_id, preemptor_id)


def drain(session: Session) -> None:
    """Every job with a node on a host being drained is stopped as if preempted (preemptible
    or not); it is queued again and placed elsewhere (contract §12)."""
    hosts = hosts_repo.draining_hosts(session)
    if not hosts:
        return
    for job_id in hosts_repo.jobs_with_nodes_on(session, hosts, (SCHEDULED, RUNNING)):
        job = lock_job(session, job_id)
        if job is None:
            continue
        mine = {r.worker_name for r in jobs_repo.runs_of(session, job.id, job.attempt)}
        where = sorted(mine.intersection(hosts)) or hosts[:1]
        if request_stop(session, job, worker=where[0]):
            log.info("job %s stopped: worker %s is being drained", job_id, where[0])
