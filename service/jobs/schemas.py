from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel

from service.schemas import CheckpointOut, Output

PROGRESS_FIELDS = (
    "epoch",
    "epochs",
    "step",
    "total_steps",
    "loss",
    "samples_per_sec",
    "val_loss",
    "val_accuracy",
)  # what a progress report may update on the Job; the metrics series carries the same


class Progress(BaseModel):
    epoch: int | None = None
    epochs: int | None = None
    step: int | None = None
    total_steps: int | None = None
    fraction: float | None = None
    loss: float | None = None
    samples_per_sec: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None


class Assignment(BaseModel):
    node_rank: int
    worker: str
    gpus: list[int]


class AttemptOut(Output):
    attempt: int
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    reason: str | None
    gpus: int = 0
    gpu_seconds: float = 0.0  # contract §9: while it runs, up to the moment it was read


class SweepOut(BaseModel):
    """A sweep parent's grid and its children's standing (contract §10)."""

    grid: dict[str, list[Any]]
    max_parallel: int | None
    children: int
    ended: int
    states: dict[str, int]  # children per state
    objective: dict[str, Any] | None = None  # {"metric", "mode"} (contract §13)
    early_stop: dict[str, Any] | None = None  # {"kind": "asha", "min_epochs", "reduction_factor"}
    best: dict[str, Any] | None = None  # {"job_id", "point", "value"}: by the children's last values


class JobOut(BaseModel):
    id: int
    name: str | None
    owner: str
    state: str
    mode: str
    nodes: int | dict[str, int]  # {"min", "max"}: an elastic job (contract §12); its size now: assignments
    gpus_per_node: int
    entrypoint: dict[str, Any]
    hyperparameters: dict[str, Any] | None
    resume_from: dict[str, Any] | None
    max_retries: int
    keep_checkpoints: int | None = None  # contract §11
    max_duration_s: int | None = None  # contract §8
    stall_timeout_s: int | None = None
    attempt: int
    priority: int
    preemptible: bool = True  # contract §12
    stop_grace_s: int = 120
    labels: dict[str, str]
    code: str | None = None  # the uploaded Code the job runs in (contract §6)
    environment: dict[str, Any] | None = None
    progress: Progress
    assignments: list[Assignment]
    latest_checkpoint: CheckpointOut | None
    error: str | None
    exit_code: int | None
    pending_reason: str | None
    queue_position: int | None
    attempts: list[AttemptOut]
    gpu_seconds: float = 0.0  # every attempt's, failed and cancelled ones too (contract §9)
    depends_on: list[dict[str, Any]] = []  # [{"job_id", "condition"}] (contract §10)
    kind: str = "job"  # "sweep" for a sweep's parent (contract §10)
    parent_id: int | None = None  # a sweep's child: its parent
    sweep_point: dict[str, Any] | None = None  # a sweep's child: its values, by spec path
    sweep: SweepOut | None = None  # a sweep's parent: its grid and its children's states
    stopped_early: dict[str, Any] | None = None  # {"epoch", "value"}: an ASHA rung stopped it (§13)
    objective_value: float | None = None  # a sweep child's last value of its sweep's objective (§13)
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobList(BaseModel):
    items: list[JobOut]
    next_cursor: str | None


class EventOut(Output):
    seq: int
    ts: datetime
    type: str
    data: dict[str, Any]


class EventList(BaseModel):
    items: list[EventOut]


class MetricsOut(BaseModel):
    names: list[str] = []  # every name the job reported (contract §13)
    series: list[dict[str, Any]]
