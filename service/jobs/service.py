"""Job logic behind the API: submit, read, list, cancel, events and metrics.

Functions take a session inside the caller's transaction and raise domain errors; they never
commit (the request's session dependency does) and never import FastAPI.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.checkpoints import repository as checkpoints_repo
from service.config import Settings
from service.errors import InvalidSpec, NotFound, TorchJobsError
from service.jobs import preemption
from service.jobs import repository as repo
from service.jobs.dependencies import add_dependencies, fail_dependants
from service.jobs.schemas import (
    PROGRESS_FIELDS,
    Assignment,
    AttemptOut,
    EventOut,
    JobOut,
    Progress,
    SweepOut,
)
from service.jobs.spec import JobSpec, NodeRange
from service.jobs.states import (
    ALL_STATES,
    CANCELLED,
    CANCELLING,
    QUEUED,
    TERMINAL,
    create_job,
    create_job_if,
    transition_job,
)
from service.jobs.submit_cache import (
    WRITE_GUARD,
    Caller,
    SubmitCache,
    Submitter,
    fresh_user,
    read_cluster,
)
from service.jobs.sweeps import (
    SWEEP,
    cancel_sweep,
    create_children,
    expand_sweep,
    sweep_parent,
    validate_children,
)
from service.jobs.validation import validate_in_context
from service.models import Job, User, utcnow
from service.schemas import MAX_ID, checkpoint_out
from service.states import JobState
from service.storage import Storage
from service.usage.accounting import attempt_gpu_seconds


class Viewer(Protocol):
    """Who is looking: a `User`, or the view cache's record of one."""

    @property
    def id(self) -> int: ...

    @property
    def name(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Submitted:
    """A submit's outcome: the job; whether this request created it (not an Idempotency-Key's
    first job); its queue position when the write answered it (None: ask the view); and the
    caller as checked, for the view's owner name."""

    job: Job
    created: bool
    position: int | None
    owner: Viewer


def submit(
    session: Session,
    settings: Settings,
    storage: Storage,
    submitter: Submitter,
    cache: SubmitCache,
    spec: JobSpec,
    idempotency_key: str | None,
) -> Submitted:
    """`submit_job` for `POST /v1/jobs`: a plain job (no Idempotency-Key, no sweep, no
    `depends_on`: its dependency rows wait on the scheduler's row locks, and the queue count's
    row lock would be held all that time, stalling every submit at its priority) is checked
    against the process's copies of its caller and of the cluster and written by one guarded
    statement (`_submit_guarded`); anything else, or a guard that failed, or a refusal made
    from a copy, takes the path that reads the tables, as before the copies existed."""
    guarded = idempotency_key is None and spec.sweep is None and not spec.depends_on
    if guarded:
        done = _submit_guarded(session, settings, storage, submitter, cache, spec)
        if done is not None:
            return done
    # (after a failed guard the row read in this request may be what failed it: read again)
    user = (submitter.user if not guarded else None) or fresh_user(session, submitter.caller.token_hash)
    cache.store_caller(Caller.of(user, submitter.caller.token_hash))
    job, created = submit_job(session, settings, storage, user, spec, idempotency_key)
    return Submitted(job, created, None, user)


def _submit_guarded(
    session: Session,
    settings: Settings,
    storage: Storage,
    submitter: Submitter,
    cache: SubmitCache,
    spec: JobSpec,
) -> Submitted | None:
    """None, having written nothing, when a copy may have decided the outcome: a refusal
    made from a copy (the tables may say otherwise), or a guard that found a copy stale."""
    cluster = cache.cluster
    read_now = cluster is None
    if cluster is None and (cluster := read_cluster(session)) is not None:
        cache.store_cluster(cluster)
    if cluster is None:
        return None
    user = submitter.checked_user()
    try:
        resume_checkpoint_id = validate_in_context(session, settings, storage, spec, user, cluster)
    except TorchJobsError:
        if submitter.verified and read_now:
            raise  # both read in this transaction: the tables' own answer
        return None
    job = new_job(session, user, spec, resume_checkpoint_id, None)
    params = {**submitter.caller.guard_params(), "hosts_version": cluster.version}
    position = create_job_if(session, job, WRITE_GUARD, params)
    if position is None:
        cache.forget(submitter.caller.token_hash, cluster)
        return None
    return Submitted(job, True, position, user)


def submit_job(
    session: Session,
    settings: Settings,
    storage: Storage,
    user: User,
    spec: JobSpec,
    idempotency_key: str | None,
) -> tuple[Job, bool]:
    """Returns (job, created). A repeated Idempotency-Key returns the first job, never a second.
    A sweep is validated whole, child by child, before anything is written (contract §10)."""
    if idempotency_key is not None:
        existing = repo.get_by_idempotency_key(session, user.id, idempotency_key)
        if existing is not None:
            return existing, False
    if spec.sweep is not None:
        children = expand_sweep(spec)
        resume_ids = validate_children(
            children, lambda child: validate_in_context(session, settings, storage, child, user)
        )
        job = sweep_parent(new_job(session, user, spec, None, idempotency_key), spec, len(children))
    else:
        resume_checkpoint_id = validate_in_context(session, settings, storage, spec, user)
        job = new_job(session, user, spec, resume_checkpoint_id, idempotency_key)
    existing = _create_once(session, job, user, idempotency_key)
    if existing is not None:
        return existing, False
    if spec.sweep is not None:
        create_children(session, job, children, resume_ids, lambda c, r: new_job(session, user, c, r, None))
    elif spec.depends_on:
        add_dependencies(session, job, spec)
    return job, True


def _create_once(session: Session, job: Job, user: User, idempotency_key: str | None) -> Job | None:
    """Create the job; the job a concurrent request with the same key created, if it won."""
    if idempotency_key is None:
        create_job(session, job)
        return None
    try:
        # A SAVEPOINT (two round trips) only where a duplicate key is a normal outcome: a
        # concurrent request with the same key won the race, and its job is the answer.
        with session.begin_nested():
            create_job(session, job)
    except IntegrityError:
        existing = repo.get_by_idempotency_key(session, user.id, idempotency_key)
        if existing is None:
            raise
        return existing
    return None


def new_job(
    session: Session, user: User, spec: JobSpec, resume_checkpoint_id: int | None, idempotency_key: str | None
) -> Job:
    """The row for a spec, not yet added: `create_job` enters it into the machine."""
    hyper = spec.effective_hyperparameters()
    return Job(
        owner_id=user.id,
        name=spec.name,
        kind="job",
        mode=spec.mode,
        nodes=spec.node_range[0],
        nodes_min=spec.node_range[0] if isinstance(spec.nodes, NodeRange) else None,
        nodes_max=spec.node_range[1] if isinstance(spec.nodes, NodeRange) else None,
        gpus_per_node=spec.gpus_per_node,
        entrypoint=spec.entrypoint.model_dump(),
        hyperparameters=hyper.model_dump() if hyper else None,
        resume_from=spec.resume_from.model_dump(exclude_none=True) if spec.resume_from else None,
        resume_checkpoint_id=resume_checkpoint_id,
        progress=_progress_from(session, resume_checkpoint_id),
        env=spec.env,
        labels=spec.labels,
        code=spec.code,
        environment=spec.environment.model_dump() if spec.environment else None,
        depends_on=[d.model_dump() for d in spec.depends_on] or None,
        max_retries=spec.max_retries,
        keep_checkpoints=spec.keep_checkpoints,
        max_duration_s=spec.max_duration_s,
        stall_timeout_s=spec.stall_timeout_s,
        priority=spec.priority,
        preemptible=spec.preemptible,
        stop_grace_s=spec.stop_grace_s,
        attempt=1,
        idempotency_key=idempotency_key,
        pending_reason="waiting for the scheduler",
    )


def _progress_from(session: Session, checkpoint_id: int | None) -> dict[str, Any] | None:
    """A job resuming after epoch 2 reports epoch 2 from the start, not nothing."""
    ckpt = checkpoints_repo.by_id(session, checkpoint_id) if checkpoint_id else None
    if ckpt is None or ckpt.epoch is None:
        return None
    return {"epoch": ckpt.epoch, "step": ckpt.step}


def get_job(session: Session, user: User, job_id: int) -> Job:
    job = repo.get_job(session, job_id, None if user.is_admin else user.id)
    if job is None:
        raise NotFound("job")
    return job


@dataclass(frozen=True, slots=True)
class ListQuery:
    """What `GET /v1/jobs` asks for; `parent`: a sweep's children only."""

    state: str | None = None
    limit: int = 50
    cursor: str | None = None
    parent: int | None = None
    order: str | None = None  # "objective": a sweep's children by their last value (contract §13)


def list_job_ids(conn: Connection, owner_id: int | None, query: ListQuery) -> tuple[list[int], str | None]:
    """The ids of one page, newest first, and the cursor of the next (None on the last page).
    `owner_id=None`: every owner's (the admin's view); a `parent` that is not the caller's is a
    404, as if it did not exist."""
    if query.state is not None and query.state not in ALL_STATES:
        raise InvalidSpec(("state",), f"unknown state; one of {', '.join(ALL_STATES)}")
    if query.order is not None and query.order != "objective":
        raise InvalidSpec(("order",), 'unknown order; "objective" (with parent), or none: newest first')
    if query.order is not None and query.parent is None:
        raise InvalidSpec(("order",), "order=objective lists a sweep's children: give parent")
    before = _parse_cursor(query.cursor)
    if query.parent is not None and not repo.job_exists(conn, query.parent, owner_id):
        raise NotFound("job")
    if query.order is not None and query.parent is not None:
        return _by_objective(conn, query.parent, query.state, query.limit, before or 0)
    ids = repo.list_job_ids(conn, owner_id, query.state, query.limit + 1, before, query.parent)
    page = ids[: query.limit]
    return page, str(page[-1]) if len(ids) > query.limit and page else None


def _by_objective(
    conn: Connection, parent_id: int, state: str | None, limit: int, offset: int
) -> tuple[list[int], str | None]:
    """A sweep's children best first by their last value of its objective, those without one
    last (then by id); the cursor is the offset of the next page (a sweep has at most 1,000)."""
    ids = repo.children_by_objective(conn, parent_id, state, limit + 1, offset)
    page = ids[:limit]
    return page, str(offset + limit) if len(ids) > limit else None


def _parse_cursor(cursor: str | None) -> int | None:
    if cursor is None or cursor == "":
        return None
    if not re.fullmatch(r"[0-9]{1,10}", cursor) or int(cursor) > MAX_ID + 1:
        raise InvalidSpec(("cursor",), "invalid cursor")
    return int(cursor)


def cancel_job(session: Session, user: User, job_id: int) -> Job:
    """Queued: through `cancelling` to `cancelled` at once (nothing runs; the contract's path
    for every cancel, so a client following state events sees the same two). Placed or
    running: `cancelling`; the nodes finish the move."""
    from service.errors import Conflict
    from service.jobs.states import lock_job

    job = get_job(session, user, job_id)
    job = lock_job(session, job.id) or job
    if job.state in (CANCELLING, CANCELLED):
        return job
    if job.state in TERMINAL:
        raise Conflict(f"job {job.id} already {job.state}")
    if job.kind == SWEEP:
        cancel_sweep(session, job)
        return job
    was_queued = job.state == QUEUED
    transition_job(session, job, CANCELLING, "cancelled by user")
    if was_queued:
        transition_job(session, job, CANCELLED, "cancelled by user")
    fail_dependants(session, job.id, "was cancelled")  # contract §10: in the cancel's transaction
    return job


def list_events(
    session: Session, job: Job, after: int, limit: int = 1000, viewer: User | None = None
) -> list[EventOut]:
    items = [EventOut.model_validate(e) for e in repo.events_after(session, job.id, after, limit)]
    return preemption.redact(session, viewer, job.id, items)  # a preemptor's id (contract §12)


def progress_of(job: Job) -> Progress:
    data: dict[str, Any] = dict(job.progress or {})
    if job.kind == SWEEP:  # the share of children that ended (contract §10)
        children = data.get("children") or 0
        return Progress(fraction=(data.get("ended", 0) / children) if children else 1.0)
    if job.hyperparameters and data.get("epochs") is None:
        data["epochs"] = job.hyperparameters.get("epochs")
    total, step = data.get("total_steps"), data.get("step")
    fraction = None
    if total and step is not None:
        fraction = min(1.0, step / total)
    elif data.get("epochs") and data.get("epoch") is not None:
        fraction = min(1.0, data["epoch"] / data["epochs"])
    if job.state == JobState.SUCCEEDED:
        fraction = 1.0
    return Progress(**{k: data.get(k) for k in PROGRESS_FIELDS}, fraction=fraction)


def sweep_out(job: Job) -> SweepOut | None:
    if job.kind != SWEEP or job.sweep is None:
        return None
    progress = job.progress or {}
    return SweepOut(
        grid=job.sweep.get("grid", {}),
        max_parallel=job.sweep.get("max_parallel"),
        children=progress.get("children", 0),
        ended=progress.get("ended", 0),
        states=progress.get("states", {}),
        objective=job.sweep.get("objective"),
        early_stop=job.sweep.get("early_stop"),
        best=job.sweep.get("best"),
    )


def job_views(
    session: Session,
    jobs: Sequence[Job],
    viewer: Viewer | None = None,
    created: bool = False,
    positions: dict[int, int] | None = None,
) -> list[JobOut]:
    """Assemble Job responses with one query per related table, not one per job.

    Tables whose answer is known are not asked: the owner's name when every job is the
    viewer's own, node runs when every job is queued (a queued job shows no assignments),
    attempts and checkpoints of jobs `created` in this very transaction (none can exist yet),
    and the queue positions when `positions` holds every queued job's (the submit's write
    answered its own)."""
    if not jobs:
        return []
    ids = {j.id for j in jobs}
    owners = _owner_names(session, jobs, viewer)
    runs: dict[int, list[Assignment]] = {}
    placed = {(j.id, j.attempt) for j in jobs if j.state != QUEUED}
    for run in repo.node_runs_for(session, placed):
        runs.setdefault(run.job_id, []).append(
            Assignment(node_rank=run.node_rank, worker=run.worker_name, gpus=list(run.gpus))
        )
    attempts: dict[int, list[AttemptOut]] = {}
    now = utcnow()
    for att in repo.attempts_for(session, ids) if not created else []:
        out = AttemptOut.model_validate(att)
        out.gpu_seconds = round(attempt_gpu_seconds(att, now), 3)
        attempts.setdefault(att.job_id, []).append(out)
    latest = repo.latest_checkpoints(session, ids) if not created else {}
    queued = {j.id for j in jobs if j.state == QUEUED}  # (a new job may have failed already)
    if positions is None or not queued <= positions.keys():
        positions = repo.queue_positions(session, jobs)
    positions = {job_id: n for job_id, n in positions.items() if job_id in queued}
    return [
        JobOut(
            id=j.id,
            name=j.name,
            owner=owners.get(j.owner_id, "?"),
            state=j.state,
            mode=j.mode,
            nodes=j.nodes if j.nodes_min is None else {"min": j.nodes_min, "max": j.nodes_max},
            gpus_per_node=j.gpus_per_node,
            entrypoint=j.entrypoint,
            hyperparameters=j.hyperparameters,
            resume_from=j.resume_from,
            max_retries=j.max_retries,
            keep_checkpoints=j.keep_checkpoints,
            max_duration_s=j.max_duration_s,
            stall_timeout_s=j.stall_timeout_s,
            attempt=j.attempt,
            priority=j.priority,
            preemptible=j.preemptible if j.preemptible is not None else True,
            stop_grace_s=j.stop_grace_s or 120,
            labels=j.labels or {},
            code=j.code,
            environment=j.environment,
            progress=progress_of(j),
            assignments=runs.get(j.id, []),
            latest_checkpoint=checkpoint_out(latest[j.id]) if j.id in latest else None,
            error=j.error,
            exit_code=j.exit_code,
            pending_reason=j.pending_reason if j.state == QUEUED else None,
            queue_position=positions.get(j.id),
            attempts=attempts.get(j.id, []),
            depends_on=list(j.depends_on or []),
            kind=j.kind or "job",
            parent_id=j.parent_id,
            sweep_point=j.sweep_point,
            sweep=sweep_out(j),
            stopped_early=j.stopped_early,
            objective_value=j.objective_value,
            gpu_seconds=round(sum(a.gpu_seconds for a in attempts.get(j.id, [])), 3),
            created_at=j.created_at,
            started_at=j.started_at,
            finished_at=j.finished_at,
        )
        for j in jobs
    ]


def _owner_names(session: Session, jobs: Sequence[Job], viewer: Viewer | None) -> dict[int, str]:
    owner_ids = {j.owner_id for j in jobs}
    if viewer is not None and owner_ids == {viewer.id}:
        return {viewer.id: viewer.name}
    return repo.owner_names(session, owner_ids)
