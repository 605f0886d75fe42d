"""The node seam's values: what a running node is given and reports, with no database import.

The supervisor builds these next to torchrun on a worker host (`workers.launcher`, which a
test imports without SQLAlchemy); the lifecycle (`service.jobs.lifecycle`) and the report
writer (`service.jobs.reports`) store them. Importing this module loads only
`service.states` (and the empty `service.nodes` package), never the rest of the seam.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

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
    # read while the node stops (its stall's stacks, its last words): not a sign of life, so
    # it leaves the job's stall clock, which the other nodes still read, where it was
    stopping: bool = False

    def __bool__(self) -> bool:
        return bool(self.logs or self.events)


class JobControl(NamedTuple):
    """The job as a supervisor's look finds it: what it acts on."""

    state: JobState | str
    attempt: int
    last_report_at: datetime | None = None  # any rank of any node, stored (contract §8 stalls)
    stop: str | None = None  # "early_stop": the ranks are asked to checkpoint and stop (contract §13)
    # contract §12: set while a stop is asked of the attempt (preempted, or its host drained):
    # the seconds its ranks get between SIGTERM and SIGKILL
    stop_grace_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class NodeLimits:
    """A node's clocks (contract §8), read at its claim. `time_left_s` is what the job's
    `max_duration_s` leaves after its earlier attempts; `max_duration_s` is said in the error."""

    stall_timeout_s: float | None = None
    time_left_s: float | None = None
    max_duration_s: int | None = None
    peer_exit_timeout_s: float | None = None  # a multi-node job's straggler (the worker's setting)
