from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    true,
)
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, UTCDateTime, utcnow


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("owner_id", "idempotency_key"),
        Index("ix_jobs_queue", "state", "priority", "id"),
        Index("ix_jobs_owner_id_id", "owner_id", "id"),
        Index("ix_jobs_parent_id_id", "parent_id", "id"),
        Index("ix_jobs_kind_state", "kind", "state"),
        Index("ix_jobs_parent_objective", "parent_id", "objective_value"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    name: Mapped[str | None] = mapped_column(String(128))
    # Changes only through service.jobs.states.transition_job(), which also writes the event.
    state: Mapped[str] = mapped_column(String(16))
    mode: Mapped[str] = mapped_column(String(8))
    nodes: Mapped[int] = mapped_column(Integer)
    gpus_per_node: Mapped[int] = mapped_column(Integer)
    entrypoint: Mapped[dict[str, Any]] = mapped_column(JSON)
    hyperparameters: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    resume_from: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    resume_checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"))
    env: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    code: Mapped[str | None] = mapped_column(String(64))  # an uploaded CodeArchive's sha256
    environment: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # {"pip": [...]}
    # contract §10, as submitted, for the job's view; `job_dependencies` serves the scheduler
    depends_on: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    # contract §10: "sweep" for a sweep's parent (it never runs; its state follows its
    # children), "job" for everything else, a sweep's children included
    kind: Mapped[str] = mapped_column(String(8), default="job", server_default="job")
    parent_id: Mapped[int | None] = mapped_column(Integer)  # no foreign key: see migration 0009
    sweep_point: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # a child's {path: value}
    sweep: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # the parent's {"grid", "max_parallel"}
    # contract §13: a sweep child's copy of its parent's objective {"metric", "mode"}, the
    # last value (and its epoch) reported of it, and why and where it was stopped early
    objective: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    objective_value: Mapped[float | None] = mapped_column(Float)
    objective_epoch: Mapped[int | None] = mapped_column(Integer)
    stop_intent: Mapped[str | None] = mapped_column(String(16))  # "early_stop": ranks asked to stop
    stopped_early: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # {"epoch", "value"}
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    max_retries: Mapped[int] = mapped_column(Integer, default=0)
    keep_checkpoints: Mapped[int | None] = mapped_column(Integer)  # contract §11; None keeps all
    max_duration_s: Mapped[int | None] = mapped_column(Integer)  # summed over attempts (contract §8)
    stall_timeout_s: Mapped[int | None] = mapped_column(Integer)  # None: never judged stalled
    # the last time any rank of the current attempt reported (a log byte, an event, a checkpoint)
    last_report_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # contract §12: whether a higher priority may stop it, and how long its ranks get after
    # SIGTERM; while a stop is asked of its running attempt (preempted, or its host drained),
    # since when and for which job (None: a drain); attempts not charged to `max_retries`
    preemptible: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    stop_grace_s: Mapped[int] = mapped_column(Integer, default=120, server_default="120")
    preempting_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    preempted_by: Mapped[int | None] = mapped_column(Integer)
    free_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # contract §12, elastic jobs: `nodes` is the current size, between these (NULL: a fixed size);
    # `resize_reason` ("node lost", "grow") while a resize is wanted or under way; a grow waits
    # for a checkpoint newer than `resize_wanted_at`; `last_resize_at` spaces grows apart
    nodes_min: Mapped[int | None] = mapped_column(Integer)
    nodes_max: Mapped[int | None] = mapped_column(Integer)
    resize_reason: Mapped[str | None] = mapped_column(String(16))
    resize_wanted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_resize_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    pending_reason: Mapped[str | None] = mapped_column(String(512))
    master_port: Mapped[int | None] = mapped_column(Integer)
    last_event_seq: Mapped[int] = mapped_column(Integer, default=0)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    queued_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class QueueCount(Base):
    """How many jobs are queued at each priority: a new job's `queue_position` is a sum over a
    few of these rows, not a count over the queue (which grew PostgreSQL's CPU with the queue).

    Two rows per priority, so that the writers that create jobs and those that move them do
    not queue on one row lock: `source` "new" counts jobs created queued (`create_job`), "moved"
    the net of jobs moved back into the queue (+1) and out of it (-1) by `transition_job`, and
    may be negative. Kept in the transactions that make the moves (service.jobs.states)."""

    __tablename__ = "queue_counts"

    priority: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    source: Mapped[str] = mapped_column(String(8), primary_key=True)
    jobs: Mapped[int] = mapped_column(Integer)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    ts: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    type: Mapped[str] = mapped_column(String(16))
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


class JobAttempt(Base):
    __tablename__ = "job_attempts"
    __table_args__ = (UniqueConstraint("job_id", "attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str | None] = mapped_column(Text)
    gpus: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # nodes x GPUs per node
    # contract §9: GPUs x (end - start), written when the attempt ends; while it runs, it is
    # counted up to the moment it is read (service/usage)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")


class NodeRun(Base):
    """One node of one attempt: the unit a worker runs, and the dedup key for re-delivered tasks."""

    __tablename__ = "node_runs"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "node_rank"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node_rank: Mapped[int] = mapped_column(Integer)
    worker_name: Mapped[str] = mapped_column(String(128), index=True)
    worker_session: Mapped[str | None] = mapped_column(String(64))
    gpus: Mapped[list[int]] = mapped_column(JSON)
    address: Mapped[str] = mapped_column(String(255))
    # a routed multi-node job (contract §7 v3): the node's own address, in its network
    # namespace, which the other nodes route to and meet at (node 0's: the rendezvous)
    job_address: Mapped[str | None] = mapped_column(String(45), nullable=True)
    # pending -> running -> succeeded | failed | cancelled | lost
    state: Mapped[str] = mapped_column(String(16), default="pending")
    exit_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class GpuAllocation(Base):
    """One GPU slot held by one job; the primary key makes double allocation impossible."""

    __tablename__ = "gpu_allocations"

    worker_name: Mapped[str] = mapped_column(String(128), primary_key=True)
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)


class LogChunk(Base):
    __tablename__ = "log_chunks"
    __table_args__ = (
        Index("ix_log_chunks_stream", "job_id", "attempt", "node_rank", "local_rank", "offset"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node_rank: Mapped[int] = mapped_column(Integer)
    local_rank: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class JobDependency(Base):
    """`depends_on` (contract §10): the job waits in the queue until the other job's state
    meets the condition, and fails once it never can."""

    __tablename__ = "job_dependencies"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    depends_on_id: Mapped[int] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True, index=True
    )
    condition: Mapped[str] = mapped_column(String(16))  # "succeeded" | "ended"
