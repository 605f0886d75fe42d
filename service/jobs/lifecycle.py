"""How a placed attempt's nodes move the job: start, finish, fail, get lost, get retried.

Called by the workers (inside one transaction per step) and by the scheduler's reaper. Every
function re-reads the job under a lock and checks the attempt number, so a late or repeated
report from an attempt that is already over changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.jobs.states import (
    CANCELLED,
    CANCELLING,
    FAILED,
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    lock_job,
    transition_job,
)
from service.models import Job, JobAttempt, NodeRun, utcnow

NODE_ACTIVE = ("pending", "running")


@dataclass(frozen=True, kw_only=True)
class NodeOutcome:
    state: str  # succeeded | failed | cancelled | lost
    exit_code: int | None = None
    error: str | None = None
    retryable: bool = False


def runs_of(session: Session, job_id: int, attempt: int) -> Sequence[NodeRun]:
    return (
        session.execute(
            select(NodeRun)
            .where(NodeRun.job_id == job_id, NodeRun.attempt == attempt)
            .order_by(NodeRun.node_rank)
        )
        .scalars()
        .all()
    )


def claim_node(
    session: Session, job_id: int, attempt: int, node_rank: int, worker_session: str
) -> Job | None:
    """Mark a node as started by this worker; None when it must not run (repeat, stale, cancelled)."""
    job = lock_job(session, job_id)
    if job is None or job.attempt != attempt:
        return None
    run = _run(session, job_id, attempt, node_rank)
    if run is None or run.state != "pending":
        return None
    if job.state not in (SCHEDULED, RUNNING):
        finish_node(session, job_id, attempt, node_rank, NodeOutcome(state="cancelled"))
        return None
    run.state, run.started_at, run.worker_session = "running", utcnow(), worker_session
    if job.state == SCHEDULED:
        transition_job(session, job, RUNNING, f"node {node_rank} started")
        _attempt_row(session, job).started_at = utcnow()
    return job


def finish_node(session: Session, job_id: int, attempt: int, node_rank: int, outcome: NodeOutcome) -> None:
    job = lock_job(session, job_id)
    run = _run(session, job_id, attempt, node_rank)
    if job is None or run is None:
        return
    if run.state in NODE_ACTIVE:
        run.state, run.exit_code, run.error, run.finished_at = (
            outcome.state,
            outcome.exit_code,
            outcome.error,
            utcnow(),
        )
    if job.attempt != attempt:
        return
    if job.state == CANCELLING:
        _finish_cancel_if_quiet(session, job)
    elif job.state in (SCHEDULED, RUNNING):
        if outcome.state == "succeeded":
            _succeed_if_all_done(session, job)
        else:
            end_attempt(session, job, outcome.exit_code, outcome.error or outcome.state, outcome.retryable)


def end_attempt(session: Session, job: Job, exit_code: int | None, error: str, retryable: bool) -> None:
    """The attempt failed: retry it from the latest checkpoint when allowed, else fail the job."""
    job.exit_code, job.error = exit_code, error
    for run in runs_of(session, job.id, job.attempt):
        if run.state in NODE_ACTIVE:
            run.state, run.finished_at = "lost", utcnow()
    if retryable and job.attempt <= job.max_retries:
        transition_job(session, job, QUEUED, f"retrying after: {_summary(exit_code, error)}")
        job.attempt += 1
        job.pending_reason = "waiting for the scheduler"
    else:
        transition_job(session, job, FAILED, _summary(exit_code, error))


def cancel_pending_nodes(session: Session, job: Job) -> None:
    """Nodes that never started cannot confirm anything: count them as gone."""
    for run in runs_of(session, job.id, job.attempt):
        if run.state == "pending":
            run.state, run.finished_at = "cancelled", utcnow()
    _finish_cancel_if_quiet(session, job)


def _finish_cancel_if_quiet(session: Session, job: Job) -> None:
    if all(r.state not in NODE_ACTIVE for r in runs_of(session, job.id, job.attempt)):
        transition_job(session, job, CANCELLED, "cancelled by user")


def _succeed_if_all_done(session: Session, job: Job) -> None:
    runs = runs_of(session, job.id, job.attempt)
    if runs and all(r.state == "succeeded" for r in runs):
        job.exit_code, job.error = 0, None
        transition_job(session, job, SUCCEEDED, "all nodes exited 0")


def _run(session: Session, job_id: int, attempt: int, node_rank: int) -> NodeRun | None:
    return session.execute(
        select(NodeRun).where(
            NodeRun.job_id == job_id, NodeRun.attempt == attempt, NodeRun.node_rank == node_rank
        )
    ).scalar_one_or_none()


def _attempt_row(session: Session, job: Job) -> JobAttempt:
    row = session.execute(
        select(JobAttempt).where(JobAttempt.job_id == job.id, JobAttempt.attempt == job.attempt)
    ).scalar_one_or_none()
    if row is None:
        row = JobAttempt(job_id=job.id, attempt=job.attempt)
        session.add(row)
    return row


def open_attempt(session: Session, job: Job) -> JobAttempt:
    return _attempt_row(session, job)


def _summary(exit_code: int | None, error: str) -> str:
    """A one-line reason for the state event; the whole story stays in `job.error`."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    if len(lines) == 1 and len(lines[0]) <= 300:
        return lines[0]
    return f"exit code {exit_code}" if exit_code is not None else (lines[-1] if lines else error)[:300]
