"""Sweeps (contract §10): one request, one parent job, one ordinary child job per grid point.

The parent never runs. It is `running` from its creation while any child is not terminal;
the scheduler's bookkeeping (`settle_sweeps`, in a transaction of its own, after each pass)
keeps its progress and moves it to `succeeded` or `failed` once every child has ended.
`max_parallel` is a placement rule (`service.scheduler.placement`). A cancel of the parent
cancels every child in its own transaction.

Lock order, everywhere: the parent's row, then its children's. A child's own transitions
(a node ending, the scheduler placing it) lock the child alone, so they never wait on the
parent, and nothing that holds a child's lock ever asks for its parent's.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from service.errors import InvalidSpec
from service.jobs import repository as repo
from service.jobs.asha import review_sweeps
from service.jobs.dependencies import add_dependencies, fail_dependants
from service.jobs.spec import JobSpec
from service.jobs.states import append_event, create_job, lock_job, transition_job
from service.models import Job
from service.scheduler.placement import SweepLimit
from service.schemas import json_safe
from service.states import JOB_TERMINAL, SWEEP, JobState

# What `validate_in_context` reads of a spec: children equal in these are checked once.
CONTEXT_FIELDS = (
    "mode",
    "nodes",
    "gpus_per_node",
    "entrypoint",
    "code",
    "priority",
    "depends_on",
    "resume_from",
)


@dataclass(frozen=True)
class Child:
    index: int
    point: dict[str, Any]  # {"hyperparameters.lr": 0.1, ...}
    spec: JobSpec


def expand_sweep(spec: JobSpec) -> list[Child]:
    """Every point of the grid as the spec its child would have been submitted with; the
    first point that would not be accepted alone is a 422 naming it, and nothing is made."""
    assert spec.sweep is not None
    base = spec.model_dump(mode="json", exclude_unset=True, exclude={"sweep"})
    paths = list(spec.sweep.grid)
    children = []
    for index, values in enumerate(itertools.product(*(spec.sweep.grid[p] for p in paths))):
        point = dict(zip(paths, values, strict=True))
        children.append(Child(index, point, _child_spec(base, point, index)))
    return children


def _child_spec(base: dict[str, Any], point: dict[str, Any], index: int) -> JobSpec:
    raw = copy.deepcopy(base)
    for path, value in point.items():
        *parents, leaf = path.split(".")
        node = raw
        for depth, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                where = ".".join(parents[: depth + 1])
                msg = f"{where} is not an object; no field to vary inside it"
                raise InvalidSpec(("sweep", "grid", path), msg)
        node[leaf] = value
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise _point_error(exc, point, index) from None


def _point_error(exc: ValidationError, point: dict[str, Any], index: int) -> InvalidSpec:
    first = exc.errors(include_url=False)[0]
    field = ".".join(str(p) for p in first["loc"])
    blamed = [p for p in point if field == p or field.startswith(p + ".") or p.startswith(field + ".")]
    shown = json.dumps(json_safe(point), separators=(", ", ": "))[:300]
    msg = f"point {index} {shown}: {field or 'spec'}: {first['msg']}"
    return InvalidSpec(("sweep", "grid", blamed[0]) if blamed else ("sweep", "grid"), msg)


def validate_children(children: list[Child], validate: Callable[[JobSpec], int | None]) -> list[int | None]:
    """Each child's checks against the cluster and the database, once per distinct context:
    a grid over hyperparameters costs one check, not a thousand. Returns each child's resume
    checkpoint id. A failure names the point."""
    verdicts: dict[str, int | None] = {}
    out = []
    for child in children:
        key = _context_key(child.spec)
        if key not in verdicts:
            try:
                verdicts[key] = validate(child.spec)
            except InvalidSpec as exc:
                shown = json.dumps(json_safe(child.point))[:300]
                for error in exc.detail:
                    error["msg"] = f"sweep point {child.index} {shown}: {error['msg']}"
                raise
        out.append(verdicts[key])
    return out


def _context_key(spec: JobSpec) -> str:
    data = spec.model_dump(mode="json", include=set(CONTEXT_FIELDS))
    hyper = spec.hyperparameters
    data["amp"] = hyper.amp if hyper is not None else None
    return json.dumps(data, sort_keys=True)


def sweep_parent(job: Job, spec: JobSpec, children: int) -> Job:
    """The parent: the spec as submitted, grid and all; it holds no GPU and never runs."""
    assert spec.sweep is not None
    job.kind = SWEEP
    job.sweep = spec.sweep.model_dump(mode="json")
    job.depends_on = None  # its children wait; the parent itself is never queued for anything
    job.progress = {"children": children, "ended": 0, "states": {JobState.QUEUED.value: children}}
    job.pending_reason = None
    return job


def create_children(
    session: Session,
    parent: Job,
    children: list[Child],
    resume_ids: list[int | None],
    make: Callable[[JobSpec, int | None], Job],
) -> None:
    """In the parent's transaction: every child or none."""
    transition_job(session, parent, JobState.RUNNING, f"sweep of {len(children)} children")
    for child, resume_id in zip(children, resume_ids, strict=True):
        job = make(child.spec, resume_id)
        job.parent_id, job.sweep_point = parent.id, child.point
        job.objective = (parent.sweep or {}).get("objective")  # what its reports are compared by (§13)
        create_job(session, job, f"child {child.index} of sweep {parent.id}")
        if child.spec.depends_on:
            add_dependencies(session, job, child.spec)


def cancel_sweep(session: Session, parent: Job) -> None:
    """The parent (locked by the caller) to `cancelling`, every child that has not ended with
    it, and the parent to `cancelled` at once when no child is left running."""
    transition_job(session, parent, JobState.CANCELLING, "cancelled by user")
    for child_id in repo.child_ids(session, parent.id, exclude=JOB_TERMINAL):
        child = lock_job(session, child_id)
        if child is None or child.state in JOB_TERMINAL or child.state == JobState.CANCELLING:
            continue
        was_queued = child.state == JobState.QUEUED
        transition_job(session, child, JobState.CANCELLING, f"sweep {parent.id} cancelled")
        if was_queued:
            transition_job(session, child, JobState.CANCELLED, f"sweep {parent.id} cancelled")
        fail_dependants(session, child.id, "was cancelled")
    settle(session, parent)


def settle_sweeps(session: Session) -> int:
    """Bring every live parent up to date with its children; returns how many changed. One
    grouped count finds them; only the parents whose counts moved are locked and written."""
    live = repo.live_sweeps(session)
    if not live:
        return 0
    changed = review_sweeps(session)  # objectives and rungs first: a stop may end a child sooner
    counts = repo.state_counts(session, [row.id for row in live])
    for row in live:
        if (row.progress or {}).get("states") != counts.get(row.id, {}):
            parent = lock_job(session, row.id)
            if parent is not None and settle(session, parent):
                changed += 1
    return changed


def settle(session: Session, parent: Job) -> bool:
    """The parent (locked) from its children, counted under that lock: progress, and its end
    once every child has ended. False when nothing changed."""
    if parent.state in JOB_TERMINAL:
        return False
    counts = repo.state_counts(session, [parent.id]).get(parent.id, {})
    total = sum(counts.values())
    ended = sum(n for state, n in counts.items() if state in JOB_TERMINAL)
    progress = {"children": total, "ended": ended, "states": counts}
    if progress == parent.progress:
        return False
    parent.progress = progress
    append_event(session, parent.id, "progress", {"fraction": ended / total if total else 1.0, **progress})
    if ended < total:
        return True
    if parent.state == JobState.CANCELLING:
        transition_job(session, parent, JobState.CANCELLED, "cancelled by user")
    elif counts.get(JobState.SUCCEEDED, 0) == total:
        transition_job(session, parent, JobState.SUCCEEDED, f"all {total} children succeeded")
    else:
        parent.error = _failure_summary(session, parent.id, total)
        transition_job(session, parent, JobState.FAILED, parent.error)
    return True


def _failure_summary(session: Session, parent_id: int, total: int) -> str:
    rows = repo.unsucceeded_children(session, parent_id)
    named = ", ".join(f"{r.id} {r.state}" for r in rows[:10]) + (", ..." if len(rows) > 10 else "")
    return f"{len(rows)} of {total} children did not succeed: jobs {named}"


def sweep_limits(session: Session, parent_ids: set[int]) -> dict[int, SweepLimit]:
    """`max_parallel` of each sweep with children in the queue, and how many of its children
    hold GPUs now (read in the scheduling pass's transaction)."""
    if not parent_ids:
        return {}
    rows = repo.sweep_specs(session, parent_ids)
    limits = {
        row.id: SweepLimit(limit=int(most)) for row in rows if (most := (row.sweep or {}).get("max_parallel"))
    }
    if limits:
        for parent_id, n in repo.active_children(session, list(limits)):
            if parent_id in limits:
                limits[parent_id].active = int(n)
    return limits
