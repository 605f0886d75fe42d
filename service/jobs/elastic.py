"""Elastic jobs (contract §12): a job of `nodes: {min, max}` runs on as many nodes as fit.

A resize is a stop and a new placement, never a change under running ranks: the attempt is
stopped as a preemption is (`service.jobs.preemption`), the job is queued again in its old
place with `resize_reason` set, and the next pass places it on as many nodes as fit; the
new attempt's ranks resume from the latest checkpoint at the new `WORLD_SIZE`. Two causes:
a lost node (at once, whatever the interval) and growing back (decided by the scheduler,
`service.scheduler.resizes`, at the job's next checkpoint). Neither is charged to
`max_retries`; each is an attempt ending `resized` and a `resize` event.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.jobs.preemption import begin_stop
from service.jobs.repository import LOST_NODE
from service.jobs.states import append_event
from service.models import Job, utcnow

GROW = "grow"
RESIZE_EVENT = "resize"

__all__ = ["GROW", "LOST_NODE", "RESIZE_EVENT", "grow_now", "lose_node", "placed"]


def placed(session: Session, job: Job, count: int) -> None:
    """A (locked) job being placed on `count` nodes: its size for this attempt, and the
    `resize` event when it comes back from a resize."""
    if job.nodes_min is None:
        return
    if job.resize_reason is not None:
        data = {"from": job.nodes, "to": count, "reason": job.resize_reason}
        append_event(session, job.id, RESIZE_EVENT, data)
        job.last_resize_at = utcnow()
        job.resize_reason = None
    job.nodes = count


def lose_node(session: Session, job: Job) -> bool:
    """One node of a (locked) running elastic job is gone: the attempt stops on the others at
    once (their grace is short: their collectives cannot finish) and the job is placed again
    on as many nodes as fit, from its latest checkpoint. False: not elastic, the caller
    retries as for any job."""
    if job.nodes_min is None:
        return False
    job.resize_reason, job.resize_wanted_at = LOST_NODE, None
    begin_stop(session, job)
    return True


def grow_now(session: Session, job: Job) -> None:
    """The scheduler decided a (locked) running job grows and its checkpoint since has come."""
    job.resize_reason = GROW
    begin_stop(session, job)
