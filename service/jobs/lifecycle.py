"""How a placed attempt's nodes move the job: claimed, started, finished, failed, lost, retried.

Called by the workers (inside one transaction per step) and by the scheduler's reaper. Every
function re-reads the job under a lock and checks the attempt number, so a late or repeated
report from an attempt that is already over changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from tenacity import before_sleep_log, retry, retry_if_exception_type, stop_after_delay, wait_exponential

from service.checkpoints import repository as checkpoints_repo
from service.db import Database
from service.hosts import repository as hosts_repo
from service.hosts.health import HostVerdict, failure_verdict, record_node_end
from service.jobs import elastic, preemption
from service.jobs import repository as repo
from service.jobs.repository import NODE_FAILED
from service.jobs.states import (
    ACTIVE,
    CANCELLED,
    CANCELLING,
    FAILED,
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    append_event,
    lock_job,
    transition_job,
    transition_node,
)
from service.models import Checkpoint, Job, JobAttempt, NodeRun, utcnow
from service.nodes.values import END_WRITE_PATIENCE_S, NodeKey, NodeLimits, NodeOutcome
from service.states import NODE_ACTIVE, NodeState

log = logging.getLogger("torchjobs.worker")
COUNTED_HERE = (HostVerdict.FAILED_HERE, HostVerdict.JOB_FAILED_HERE)  # failures in a host's row


@dataclass(frozen=True, kw_only=True)
class Claimed:
    """What a worker needs to launch the node it claimed, read in the claim's transaction."""

    launch_fields: dict[str, Any]
    resume: tuple[int, str, str] | None  # (checkpoint id, storage key, sha256)
    code: str | None = None  # the job's uploaded code (its SHA-256), unpacked on the worker
    pip: tuple[str, ...] = ()  # the job's environment.pip, built on the worker before its ranks
    limits: NodeLimits = NodeLimits()  # its stall timeout and what is left of its time limit


def claim_node(
    session: Session, job_id: int, attempt: int, node_rank: int, worker_session: str
) -> Job | None:
    """Mark a node as started by this worker; None when it must not run (repeat, stale, cancelled)."""
    job = lock_job(session, job_id)
    if job is None or job.attempt != attempt:
        return None
    run = repo.node_run(session, job_id, attempt, node_rank)
    if run is None or run.state != NodeState.PENDING:
        return None
    if job.state not in (SCHEDULED, RUNNING):
        finish_node(session, job_id, attempt, node_rank, NodeOutcome(state=NodeState.CANCELLED))
        return None
    transition_node(run, NodeState.RUNNING, worker_session=worker_session)
    if job.state == SCHEDULED:
        transition_job(session, job, RUNNING, f"node {node_rank} started")
        _attempt_row(session, job).started_at = utcnow()
    return job


def finish_node(session: Session, job_id: int, attempt: int, node_rank: int, outcome: NodeOutcome) -> bool:
    """True when this end failed the attempt: the first failure, not a peer's echo of it."""
    job = lock_job(session, job_id)
    run = repo.node_run(session, job_id, attempt, node_rank)
    if job is None or run is None:
        return False
    transition_node(run, outcome.state, exit_code=outcome.exit_code, error=outcome.error)
    if job.attempt != attempt:
        return False
    if job.state == CANCELLING:
        _finish_cancel_if_quiet(session, job)
    elif job.resize_reason == NODE_FAILED:  # an elastic job's failure on hold (below)
        _judge_held_failure(session, job)
    elif job.preempting_since is not None:  # stopped on purpose: queued again once all ended (§12)
        preemption.settle(session, job)
    elif job.state in (SCHEDULED, RUNNING):
        if outcome.state == NodeState.SUCCEEDED:
            _succeed_if_all_done(session, job)
        elif job.nodes_min is not None and _hold_failure(session, job, outcome):
            return False
        else:
            end_attempt(session, job, outcome.exit_code, outcome.error or outcome.state, outcome.retryable)
            return True
    return False


def _hold_failure(session: Session, job: Job, outcome: NodeOutcome) -> bool:
    """An elastic job's node failed while others run: its peer may have died with its host,
    which the reaper has not judged yet (a worker is known lost only when its heartbeats stop,
    while its peers' collectives fail at once). The other nodes are stopped and the verdict
    waits for them: a node judged lost meanwhile makes it a resize (§12), else it is the
    failure it looked like (`_judge_held_failure`)."""
    runs = repo.runs_of(session, job.id, job.attempt)
    if not outcome.retryable or not any(r.state in NODE_ACTIVE for r in runs):
        return False
    job.exit_code, job.error = outcome.exit_code, outcome.error or outcome.state
    job.resize_reason = NODE_FAILED
    preemption.begin_stop(session, job)
    return True


def _judge_held_failure(session: Session, job: Job) -> None:
    """Once every node of the held attempt has ended and none was lost: a plain failure."""
    if any(r.state in NODE_ACTIVE for r in repo.runs_of(session, job.id, job.attempt)):
        return
    job.resize_reason, job.preempting_since = None, None
    end_attempt(session, job, job.exit_code, job.error or "failed", retryable=True)


def end_attempt(session: Session, job: Job, exit_code: int | None, error: str, retryable: bool) -> None:
    """The attempt failed: retry it from the latest checkpoint when allowed, else fail the job."""
    job.exit_code, job.error = exit_code, error
    for run in repo.runs_of(session, job.id, job.attempt):
        transition_node(run, NodeState.LOST)
    if job.stop_intent is not None:  # asked to stop early (§13): this end is that stop, not a retry
        how = _summary(exit_code, error)
        job.exit_code, job.error = 0, None
        transition_job(session, job, SUCCEEDED, f"stopped early; its nodes ended: {how}")
    elif retryable and job.attempt - (job.free_attempts or 0) <= job.max_retries:  # (§12: preemptions free)
        transition_job(session, job, QUEUED, f"retrying after: {_summary(exit_code, error)}")
        job.attempt += 1
        job.pending_reason = "waiting for the scheduler"
    else:
        transition_job(session, job, FAILED, _summary(exit_code, error))


def cancel_pending_nodes(session: Session, job: Job) -> None:
    """Nodes that never started cannot confirm anything: count them as gone."""
    for run in repo.runs_of(session, job.id, job.attempt):
        if run.state == NodeState.PENDING:
            transition_node(run, NodeState.CANCELLED)
    _finish_cancel_if_quiet(session, job)


def _finish_cancel_if_quiet(session: Session, job: Job) -> None:
    if all(r.state not in NODE_ACTIVE for r in repo.runs_of(session, job.id, job.attempt)):
        transition_job(session, job, CANCELLED, "cancelled by user")


def _succeed_if_all_done(session: Session, job: Job) -> None:
    runs = repo.runs_of(session, job.id, job.attempt)
    if runs and all(r.state == NodeState.SUCCEEDED for r in runs):
        job.exit_code, job.error = 0, None
        transition_job(session, job, SUCCEEDED, "all nodes exited 0")


def _attempt_row(session: Session, job: Job) -> JobAttempt:
    row = repo.attempt_of(session, job.id, job.attempt)
    if row is None:
        row = JobAttempt(job_id=job.id, attempt=job.attempt, gpus=job.nodes * job.gpus_per_node)
        repo.add_attempt(session, row)
    return row


def open_attempt(session: Session, job: Job) -> JobAttempt:
    return _attempt_row(session, job)


def _summary(exit_code: int | None, error: str) -> str:
    """A one-line reason for the state event; the whole story stays in `job.error`."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    if len(lines) == 1 and len(lines[0]) <= 300:
        return lines[0]
    return f"exit code {exit_code}" if exit_code is not None else (lines[-1] if lines else error)[:300]


def lose_node(session: Session, run: NodeRun, reason: str) -> bool:
    """The reaper's verdict on one node: its worker is gone, or it never started in time.
    True when that ended a live attempt (what counts against the host: `service.hosts.health`)."""
    job = lock_job(session, run.job_id)
    if job is None:
        return False
    if job.attempt != run.attempt or job.state not in ACTIVE:
        transition_node(run, NodeState.LOST)
        return False
    transition_node(run, NodeState.LOST, error=reason)
    if job.state == CANCELLING:
        cancel_pending_nodes(session, job)
        return False
    if job.preempting_since is not None:  # being stopped anyway (contract §12)
        if job.resize_reason == NODE_FAILED:  # the held failure was a lost node's: a resize
            job.resize_reason, job.exit_code, job.error = elastic.LOST_NODE, None, None
        preemption.settle(session, job)
        return False
    detail = f"{reason}: node {run.node_rank} on worker {run.worker_name}"
    if job.state == RUNNING and elastic.lose_node(session, job):  # resized, not retried (§12)
        log.info("job %s resizes: %s", job.id, detail)
        return True
    end_attempt(session, job, None, detail, retryable=True)
    return True


def claim_for_launch(session: Session, key: NodeKey, worker_session: str) -> Claimed | None:
    """Claim the node and read what launching it takes; None when it must not run."""
    job = claim_node(session, key.job_id, key.attempt, key.node_rank, worker_session)
    if job is None:
        return None
    runs = {r.node_rank: r for r in repo.runs_of(session, job.id, key.attempt)}
    latest = checkpoints_repo.latest_of_job(session, job.id)
    if latest is None and job.resume_checkpoint_id is not None:
        latest = checkpoints_repo.by_id(session, job.resume_checkpoint_id)
    fields = dict(
        job_id=job.id,
        attempt=key.attempt,
        node_rank=key.node_rank,
        nnodes=job.nodes,
        mode=job.mode,
        gpus=tuple(runs[key.node_rank].gpus),
        master_addr=runs[0].address,
        master_port=job.master_port,
        entrypoint=job.entrypoint,
        hyperparameters=job.hyperparameters,
        user_env=dict(job.env or {}),
        stop_grace_s=job.stop_grace_s,
    )
    resume = (latest.id, latest.storage_key, latest.sha256) if latest else None
    if latest is not None and key.node_rank == 0:
        job.progress = resumed_progress(job.progress, latest)
    pip = tuple((job.environment or {}).get("pip") or ())
    limits = node_limits(session, job)
    return Claimed(launch_fields=fields, resume=resume, code=job.code, pip=pip, limits=limits)


def node_limits(session: Session, job: Job) -> NodeLimits:
    """The clocks of contract §8: `max_duration_s` counts every earlier attempt's run time."""
    time_left = None
    if job.max_duration_s is not None:
        earlier = repo.earlier_attempt_times(session, job.id, job.attempt)
        used = sum((end - start).total_seconds() for start, end in earlier if start and end)
        time_left = max(0.0, job.max_duration_s - used)
    return NodeLimits(
        stall_timeout_s=job.stall_timeout_s, time_left_s=time_left, max_duration_s=job.max_duration_s
    )


def resumed_progress(progress: dict[str, Any] | None, ckpt: Checkpoint) -> dict[str, Any]:
    """A resumed job counts what its checkpoint completed until it completes more (contract §2)."""
    if ckpt.epoch is None:
        return dict(progress or {})
    return {**(progress or {}), "epoch": ckpt.epoch, "step": ckpt.step}


@retry(
    retry=retry_if_exception_type(DBAPIError),
    wait=wait_exponential(multiplier=0.2, max=10),
    stop=stop_after_delay(END_WRITE_PATIENCE_S),
    before_sleep=before_sleep_log(log, logging.WARNING),
    reraise=True,
)
def record_end(db: Database, key: NodeKey, outcome: NodeOutcome, worker: str | None = None) -> None:
    """The node's end, retried while the database is away (restarting, locked, unreachable):
    if it were dropped the job would stay `running` on a live worker that no longer runs it.
    Idempotent: a node already ended keeps its first outcome. Then what the end says of the
    `worker`'s host, in a transaction of its own (`service.hosts.health` says why)."""
    with db.transaction() as session:
        ended_attempt = finish_node(session, key.job_id, key.attempt, key.node_rank, outcome)
        job = repo.job_by_id(session, key.job_id)  # locked by finish_node: whose it is, what it runs
        verdict = host_verdict(outcome, job)
        owner = job.owner_id if job is not None else None
    if worker is None:
        return
    if verdict in COUNTED_HERE and not ended_attempt:
        verdict = HostVerdict.NOTHING  # another node failed first: this one felt it (a peer's reset)
    with db.transaction() as session:
        detail = outcome.error or outcome.state
        quarantine_after = db.settings.quarantine_after
        quarantined = record_node_end(session, worker, verdict, detail, quarantine_after, owner)
    if quarantined:  # the job's row in a third transaction: a host lock is never held before a job's
        with db.transaction() as session:
            tell_quarantined(session, key.job_id, worker)


def tell_quarantined(session: Session, job_id: int, worker: str) -> None:
    """The job whose failure put its host in quarantine says so (contract §8): a `quarantine`
    event naming the host and why; its next attempt goes elsewhere."""
    row = hosts_repo.worker(session, worker)
    if row is not None and row.quarantine_reason is not None:
        append_event(session, job_id, "quarantine", {"worker": worker, "reason": row.quarantine_reason})


def host_verdict(outcome: NodeOutcome, job: Job | None = None) -> HostVerdict:
    """A retryable failure is the infrastructure's (contract §8), one the job's own code may
    have caused unless `failure_verdict` finds otherwise; success or the job's own error shows
    a host that works; a cancel or a stop from elsewhere says nothing of it."""
    if outcome.state == NodeState.FAILED:
        return failure_verdict(outcome.error or "", job) if outcome.retryable else HostVerdict.WORKED
    return HostVerdict.WORKED if outcome.state == NodeState.SUCCEEDED else HostVerdict.NOTHING
