"""Checks on a job spec that need the settings or the database, each naming its field."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.errors import InvalidSpec
from service.jobs.spec import JobSpec, ScriptEntrypoint
from service.models import Checkpoint, Job, User, Worker


def resolve_script(path: str, roots: list[Path]) -> Path:
    """The real file a script entrypoint names: symlinks followed, and it must stay in a root."""
    if not roots:
        raise InvalidSpec(
            ("entrypoint", "path"), "script entrypoints are disabled: TORCHJOBS_SCRIPT_ROOTS is empty"
        )
    raw = Path(path)
    candidates = [raw] if raw.is_absolute() else [root / raw for root in roots]
    for candidate in candidates:
        real = candidate.resolve()
        inside = any(real.is_relative_to(root) for root in roots)
        if inside and real.is_file():
            return real
    raise InvalidSpec(("entrypoint", "path"), "no such script inside the configured script roots")


def check_fits_cluster(session: Session, spec: JobSpec) -> None:
    """Refuse what no registered worker could ever hold; with no worker known yet, let it queue."""
    sizes = sorted(session.execute(select(Worker.gpus)).scalars().all(), reverse=True)
    if not sizes:
        return
    if sizes[0] < spec.gpus_per_node:
        raise InvalidSpec(
            ("gpus_per_node",),
            f"asks for {spec.gpus_per_node} GPUs per node; the largest worker has {sizes[0]}",
        )
    fitting = sum(1 for s in sizes if s >= spec.gpus_per_node)
    if fitting < spec.nodes:
        raise InvalidSpec(
            ("nodes",),
            f"asks for {spec.nodes} nodes with {spec.gpus_per_node} GPUs; "
            f"only {fitting} worker(s) have that many",
        )


def resolve_resume(session: Session, spec: JobSpec, user: User) -> int | None:
    """The checkpoint id a job resumes from; another user's is exactly as unknown as a missing one."""
    if spec.resume_from is None:
        return None
    owner_clause = [] if user.is_admin else [Checkpoint.owner_id == user.id]
    if spec.resume_from.checkpoint_id is not None:
        # FOR SHARE: retention cannot delete it between this check and our commit
        found = session.execute(
            select(Checkpoint.id)
            .where(Checkpoint.id == spec.resume_from.checkpoint_id, *owner_clause)
            .with_for_update(read=True)
        ).scalar_one_or_none()
        if found is None:
            raise InvalidSpec(("resume_from", "checkpoint_id"), "no such checkpoint")
        return found
    job_clause = [] if user.is_admin else [Job.owner_id == user.id]
    job = session.execute(
        select(Job.id).where(Job.id == spec.resume_from.job_id, *job_clause)
    ).scalar_one_or_none()
    if job is None:
        raise InvalidSpec(("resume_from", "job_id"), "no such job")
    latest = session.execute(
        select(Checkpoint.id)
        .where(Checkpoint.job_id == job)
        .order_by(Checkpoint.id.desc())
        .limit(1)
        .with_for_update(read=True)
    ).scalar_one_or_none()
    if latest is None:
        raise InvalidSpec(("resume_from", "job_id"), "that job has no checkpoint yet")
    return latest


def validate_in_context(session: Session, settings: Settings, spec: JobSpec, user: User) -> int | None:
    if isinstance(spec.entrypoint, ScriptEntrypoint):
        resolve_script(spec.entrypoint.path, settings.script_root_paths)
    check_fits_cluster(session, spec)
    return resolve_resume(session, spec, user)
