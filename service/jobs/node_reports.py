"""What a running node reports, as plain values: no database import.

The supervisor builds these next to torchrun on a worker host (`workers.launcher`, which a
test imports without SQLAlchemy); the lifecycle (`service.jobs.lifecycle`) and the report
writer (`service.jobs.reports`) store them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.states import JobState, NodeState

END_WRITE_PATIENCE_S = 600.0  # how long a node's end is retried: a database restart or fail-over


@dataclass(frozen=True, kw_only=True)
class NodeKey:
    job_id: int
    attempt: int
    node_rank: int


@dataclass(frozen=True, kw_only=True)
class NodeOutcome:
    state: NodeState  # one of NODE_ENDS
    exit_code: int | None = None
    error: str | None = None
    retryable: bool = False


@dataclass
class Batch:
    """One look's worth of output: log bytes and progress events, stored in one transaction."""

    logs: list[tuple[int, int, bytes]] = field(default_factory=list)  # (local_rank, offset, data)
    events: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.logs or self.events)


JobControl = tuple[JobState | str, int]  # the job's (state, attempt): what a supervisor acts on
