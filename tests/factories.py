"""Test data, seeded through the product's own gates: `create_job`, `transition_job`,
`transition_node` and the hosts' `upsert_worker`/`take_offline`. A test never writes a
`state` column itself (tests/test_state_gates.py checks it), so every seeded row is one the
service could have made, with its `state` events."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service.hosts.states import take_offline, upsert_worker
from service.jobs.states import create_job, lock_job, transition_job, transition_node
from service.models import Job, JobAttempt, NodeRun, User, Worker, utcnow
from service.states import JobState, NodeState, WorkerState

BUILTIN = {"kind": "builtin", "model": "cnn", "dataset": "digits"}

# The way a job usually reaches each state, from queued.
JOB_PATHS: dict[JobState, tuple[JobState, ...]] = {
    JobState.QUEUED: (),
    JobState.SCHEDULED: (JobState.SCHEDULED,),
    JobState.RUNNING: (JobState.SCHEDULED, JobState.RUNNING),
    JobState.SUCCEEDED: (JobState.SCHEDULED, JobState.RUNNING, JobState.SUCCEEDED),
    JobState.FAILED: (JobState.SCHEDULED, JobState.RUNNING, JobState.FAILED),
    JobState.CANCELLING: (JobState.SCHEDULED, JobState.RUNNING, JobState.CANCELLING),
    JobState.CANCELLED: (JobState.CANCELLING, JobState.CANCELLED),
}
NODE_PATHS: dict[NodeState, tuple[NodeState, ...]] = {
    NodeState.PENDING: (),
    NodeState.RUNNING: (NodeState.RUNNING,),
    **{end: (NodeState.RUNNING, end) for end in (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.LOST)},
    NodeState.CANCELLED: (NodeState.CANCELLED,),
}


def make_user(session: Session, name: str = "u", *, is_admin: bool = False) -> User:
    user = User(name=name, token_hash=f"{name:0>64}"[-64:], is_admin=is_admin)
    session.add(user)
    session.flush()
    return user


def make_job(
    session: Session,
    owner_id: int,
    state: str = JobState.QUEUED,
    *,
    attempt_row: bool = True,
    **fields: Any,
) -> Job:
    """A job as the API creates it, then moved along `JOB_PATHS` to `state`."""
    values: dict[str, Any] = {"mode": "single", "nodes": 1, "gpus_per_node": 1, "entrypoint": BUILTIN}
    values.update(fields)
    values.setdefault("attempt", 1)
    job = Job(owner_id=owner_id, **values)
    create_job(session, job)
    if attempt_row:
        session.add(JobAttempt(job_id=job.id, attempt=job.attempt))
        session.flush()
    move_job(session, job, state)
    return job


def move_job(session: Session, job: Job, state: str) -> Job:
    """Walk the job from queued to `state` through the gate (it must still be queued)."""
    for step in JOB_PATHS[JobState(state)]:
        transition_job(session, job, step, "seeded by a test")
    session.flush()
    return job


def set_job_state(session: Session, job_id: int, state: str) -> None:
    """One move of an existing job, through the gate (raises Conflict when not allowed)."""
    job = lock_job(session, job_id)
    assert job is not None, f"no job {job_id}"
    transition_job(session, job, state, "moved by a test")


def make_node_run(session: Session, job: Job, state: str = NodeState.PENDING, **fields: Any) -> NodeRun:
    values: dict[str, Any] = {"node_rank": 0, "worker_name": "w", "gpus": [0], "address": "127.0.0.1"}
    values.update(fields)
    run = NodeRun(job_id=job.id, attempt=job.attempt, **values)
    session.add(run)
    session.flush()
    for step in NODE_PATHS[NodeState(state)]:
        assert transition_node(run, step, worker_session="seeded")
    session.flush()
    return run


def make_worker(session: Session, name: str, state: str = WorkerState.ONLINE, **fields: Any) -> Worker:
    """A worker host as its agent registers it (then taken offline, when asked)."""
    values: dict[str, Any] = {
        "address": "127.0.0.1",
        "accelerator": "cpu",
        "gpus": 2,
        "session_id": f"{name}-session",
        "now": utcnow(),
    }
    values.update(fields)
    upsert_worker(session, name=name, **values)
    session.flush()
    worker = session.get(Worker, name)
    assert worker is not None
    if state == WorkerState.OFFLINE:
        take_offline(worker)
    return worker
