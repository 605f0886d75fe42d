"""Every state name and the moves each state machine allows: jobs, node runs, worker hosts.

Plain enums and tables, with no database import, so that the supervisor (which runs next to
torchrun on a worker host), the client and the tests share them with the server. The writers
that apply them are the gates: `service.jobs.states` (jobs and node runs) and
`service.hosts.states` (worker hosts); tests/test_state_gates.py fails when any other module
writes a `state` column.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """Contract §2."""

    QUEUED = "queued"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class NodeState(StrEnum):
    """One node of one attempt: placed (pending), claimed by its worker (running), ended."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"  # its worker went away, or the attempt ended without it


class WorkerState(StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"


JOB_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
JOB_ACTIVE = frozenset({JobState.SCHEDULED, JobState.RUNNING, JobState.CANCELLING})

JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset(
        {JobState.SCHEDULED, JobState.CANCELLING, JobState.CANCELLED, JobState.FAILED}
    ),
    JobState.SCHEDULED: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.SUCCEEDED, JobState.CANCELLING}
    ),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.QUEUED, JobState.CANCELLING}),
    JobState.CANCELLING: frozenset({JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

# A sweep's parent (contract §10) never runs itself: it is `running` from its creation while any
# child is not terminal, then `succeeded` or `failed` by its children; a cancel goes through
# `cancelling` (children stopping) to `cancelled`.
SWEEP_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLING}),
    JobState.CANCELLING: frozenset({JobState.CANCELLED}),
    JobState.SCHEDULED: frozenset(),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

NODE_ACTIVE = frozenset({NodeState.PENDING, NodeState.RUNNING})
NODE_ENDS = frozenset({NodeState.SUCCEEDED, NodeState.FAILED, NodeState.CANCELLED, NodeState.LOST})
NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    # A pending node never ran, so it cannot have succeeded or failed (a worker claims a node,
    # making it running, before anything can go wrong on it): it is cancelled, or lost.
    NodeState.PENDING: frozenset({NodeState.RUNNING, NodeState.CANCELLED, NodeState.LOST}),
    NodeState.RUNNING: NODE_ENDS,
    **{end: frozenset() for end in NODE_ENDS},
}

WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    # online -> online: a heartbeat, or a restart under the same name, refreshes the host
    WorkerState.ONLINE: frozenset({WorkerState.ONLINE, WorkerState.OFFLINE}),
    # A host taken offline for silence comes back with its next heartbeat or restart.
    WorkerState.OFFLINE: frozenset({WorkerState.ONLINE}),
}


SWEEP = "sweep"  # `Job.kind` of a sweep's parent (contract §10): its moves are SWEEP_TRANSITIONS


def job_may_move(current: str, new: str, kind: str = "job") -> bool:
    table = SWEEP_TRANSITIONS if kind == SWEEP else JOB_TRANSITIONS
    return _allowed(table, JobState, current, new)


def node_may_move(current: str, new: str) -> bool:
    return _allowed(NODE_TRANSITIONS, NodeState, current, new)


def worker_may_move(current: str, new: str) -> bool:
    return _allowed(WORKER_TRANSITIONS, WorkerState, current, new)


def _allowed(table: dict, kind: type[StrEnum], current: str, new: str) -> bool:
    try:
        return kind(new) in table.get(kind(current), frozenset())
    except ValueError:  # a name that is not a state of this machine
        return False
