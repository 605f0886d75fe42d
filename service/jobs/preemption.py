"""A running attempt stopped by the control plane (contract §12): preempted by a job of higher
priority, or on a host being drained.

The stop is asked in the database (`Job.preempting_since`): every node's supervisor sees it at
its next look, sends SIGTERM (the builtin trainer's rank 0 checkpoints), and kills what still
runs `stop_grace_s` later. The job keeps its GPUs until its last node has ended, so the job
it makes room for is never placed on slots still in use; then it is queued again, on its
next attempt, in its old place (the queue is ordered by id), not charged to `max_retries`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service.jobs import repository as repo
from service.jobs.repository import NODE_FAILED
from service.jobs.schemas import EventOut
from service.jobs.states import (
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    append_event,
    transition_job,
    transition_node,
)
from service.models import Job, User, utcnow
from service.states import NODE_ACTIVE, NodeState

PREEMPTED = "preempted"  # the ended attempt's reason, and the event's type
WAITS = "preempted, waits: "  # how a stopped job's pending_reason starts until it is placed again
WAITING = WAITS + "to be placed again, resuming from its latest checkpoint"
RESIZED = "resized"  # an elastic job's attempt ended to restart on another number of nodes
RESIZING = "resized: to be placed again on as many nodes as fit, resuming from its latest checkpoint"


def request_stop(session: Session, job: Job, *, by_job: Job | None = None, worker: str | None = None) -> bool:
    """Ask the attempt of a (locked) scheduled or running job to stop; False when it cannot
    be, or is already being, stopped. `by_job`: the preemptor; else `worker`, drained."""
    if job.state not in (SCHEDULED, RUNNING) or job.preempting_since is not None:
        return False
    job.preempting_since = utcnow()
    job.preempted_by = by_job.id if by_job is not None else None
    data: dict[str, Any] = {"by_priority": by_job.priority if by_job is not None else None}
    if by_job is not None:
        data["by_job"] = by_job.id  # shown to the preemptor's owner and the admin only (`redact`)
    if worker is not None:
        data["drained"] = worker
    append_event(session, job.id, PREEMPTED, data)
    job.resize_wanted_at = None  # an elastic job's wish to grow is dropped: it stops anyway
    begin_stop(session, job)
    return True


def begin_stop(session: Session, job: Job) -> None:
    """The attempt's nodes that never started are cancelled; the rest are asked to stop."""
    job.preempting_since = job.preempting_since or utcnow()
    for run in repo.runs_of(session, job.id, job.attempt):
        if run.state == NodeState.PENDING:  # never started: nothing to stop, and never will
            transition_node(run, NodeState.CANCELLED)
    settle(session, job)


def settle(session: Session, job: Job) -> None:
    """Once no node of the stopped attempt runs, the job is queued again (or, had every node
    finished its work meanwhile, it has succeeded)."""
    if job.preempting_since is None or job.state not in (SCHEDULED, RUNNING):
        return
    if job.resize_reason == NODE_FAILED:  # failed or lost: `lifecycle.finish_node` judges
        return
    runs = repo.runs_of(session, job.id, job.attempt)
    if any(r.state in NODE_ACTIVE for r in runs):
        return
    if runs and all(r.state == NodeState.SUCCEEDED for r in runs):
        job.exit_code, job.error = 0, None
        transition_job(session, job, SUCCEEDED, "all nodes exited 0")
        return
    resized = job.resize_reason is not None  # an elastic job's resize (kept until it is placed)
    transition_job(session, job, QUEUED, RESIZED if resized else PREEMPTED)  # frees GPUs, ends the attempt
    job.attempt += 1
    job.free_attempts += 1  # contract §12: a preemption or a resize is not charged to max_retries
    job.preempting_since, job.preempted_by, job.resize_wanted_at = None, None, None
    job.pending_reason = RESIZING if resized else WAITING


def stopping_jobs(session: Session) -> list[Job]:
    """Jobs whose attempt is being stopped, for the reaper's look at those whose nodes all ended."""
    return repo.stopping_jobs(session)


def redact(session: Session, viewer: User | None, job_id: int, items: list[EventOut]) -> list[EventOut]:
    """The preemptor's id in a `preempted` event is for its owner and the admin (contract §12):
    removed for everyone else (`viewer` None: a stream, shared by the job's owner and the admin,
    so kept only where the job's owner is the preemptor's too)."""
    hidden = [e for e in items if e.type == PREEMPTED and "by_job" in (e.data or {})]
    if not hidden or (viewer is not None and viewer.is_admin):
        return items
    preemptors = {e.data["by_job"] for e in hidden}
    owners = repo.owner_ids(session, preemptors | {job_id})
    viewer_id = viewer.id if viewer is not None else owners.get(job_id)
    for event in hidden:
        if owners.get(event.data["by_job"]) != viewer_id:
            event.data = {k: v for k, v in event.data.items() if k != "by_job"}
    return items
