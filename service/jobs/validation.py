"""Checks on a job spec that need the settings or the database, each naming its field."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from service.checkpoints import repository as checkpoints_repo
from service.checkpoints.resume_check import ResumeFile, check_resumable, resume_file
from service.code.service import usable_code
from service.config import Settings
from service.errors import InvalidSpec
from service.hosts import repository as hosts_repo
from service.jobs import repository as repo
from service.jobs.dependencies import check_dependencies, resumes_from_dependency
from service.jobs.spec import JobSpec, ScriptEntrypoint
from service.models import User
from service.storage import Storage

if TYPE_CHECKING:
    from service.jobs.submit_cache import Cluster


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


def check_code(session: Session, spec: JobSpec, user: User) -> None:
    """The job's code is the submitter's own upload; a script names a file inside it."""
    if spec.code is not None and usable_code(session, user, spec.code) is None:
        raise InvalidSpec(("code",), "no such code")
    if isinstance(spec.entrypoint, ScriptEntrypoint):
        path = PurePosixPath(spec.entrypoint.path)
        if path.is_absolute() or ".." in path.parts or "\\" in spec.entrypoint.path:
            raise InvalidSpec(("entrypoint", "path"), "with code, a path relative to the code's root")


def check_owner_limits(spec: JobSpec, user: User) -> None:
    """Contract §9: priority is the admin's to give, up to each user's `max_priority`; a job
    larger than its owner's `gpu_quota` could never start."""
    if not user.is_admin and spec.priority > user.max_priority:
        raise InvalidSpec(
            ("priority",),
            f"{spec.priority} is above your max_priority {user.max_priority} (set by the admin)",
        )
    fewest = spec.node_range[0]
    gpus = fewest * spec.gpus_per_node
    if user.gpu_quota is not None and gpus > user.gpu_quota:
        raise InvalidSpec(
            ("gpu_quota",),
            f"the job asks for {gpus} GPUs ({fewest} nodes x {spec.gpus_per_node}); "
            f"your gpu_quota is {user.gpu_quota}",
        )


def check_amp(session: Session, spec: JobSpec, cluster: Cluster | None = None) -> None:
    """fp16 needs CUDA (its GradScaler has no CPU form): refuse it where no worker has CUDA.
    The hosts' accelerators are read only for such a job, unless `cluster` holds them."""
    hyper = spec.hyperparameters
    if hyper is None or hyper.amp != "fp16":
        return
    kinds = cluster.accelerators if cluster is not None else hosts_repo.accelerators(session)
    if kinds and "cuda" not in kinds:
        raise InvalidSpec(
            ("hyperparameters", "amp"), "fp16 needs a CUDA worker and none is registered; use bf16"
        )


def check_fits_cluster(session: Session, spec: JobSpec, cluster: Cluster | None = None) -> None:
    """Refuse what no registered worker could ever hold; with no worker known yet, let it queue.
    The hosts are read, unless `cluster` holds them (a copy the job's INSERT checks)."""
    sizes = cluster.sizes if cluster is not None else sorted(hosts_repo.gpu_counts(session), reverse=True)
    if not sizes:
        return
    if sizes[0] < spec.gpus_per_node:
        raise InvalidSpec(
            ("gpus_per_node",),
            f"asks for {spec.gpus_per_node} GPUs per node; the largest worker has {sizes[0]}",
        )
    fitting = sum(1 for s in sizes if s >= spec.gpus_per_node)
    if fitting < spec.node_range[0]:
        raise InvalidSpec(
            ("nodes",),
            f"asks for {spec.node_range[0]} nodes with {spec.gpus_per_node} GPUs; "
            f"only {fitting} worker(s) have that many",
        )


def resume_target(
    session: Session, spec: JobSpec, user: User, *, lock: bool
) -> tuple[ResumeFile, str] | None:
    """The file a job resumes from and the spec field that named it. Another user's is
    exactly as unknown as a missing one. With `lock`, FOR SHARE: retention cannot delete it
    between this check and the caller's commit."""
    if spec.resume_from is None:
        return None
    owner = None if user.is_admin else user.id
    if spec.resume_from.checkpoint_id is not None:
        found = checkpoints_repo.get(session, spec.resume_from.checkpoint_id, owner, share_lock=lock)
        if found is None:
            raise InvalidSpec(("resume_from", "checkpoint_id"), "no such checkpoint")
        return resume_file(session, found), "checkpoint_id"
    job = repo.visible_job_id(session, spec.resume_from.job_id, owner)
    if job is None:
        raise InvalidSpec(("resume_from", "job_id"), "no such job")
    latest = checkpoints_repo.latest_of_job(session, job, share_lock=lock)
    if latest is None:
        raise InvalidSpec(("resume_from", "job_id"), "that job has no checkpoint yet")
    return resume_file(session, latest), "job_id"


def resolve_resume(
    session: Session, settings: Settings, storage: Storage, spec: JobSpec, user: User
) -> int | None:
    """The checkpoint id a job resumes from, once it is known to load with weights_only; None
    too for a dependency's checkpoint, taken at placement (`service.jobs.dependencies`)."""
    if resumes_from_dependency(spec):
        return None
    target = resume_target(session, spec, user, lock=True)
    if target is None:
        return None
    check_resume_kind(spec, *target)
    check_resumable(storage, settings, *target)
    return target[0].id


def check_resume_kind(spec: JobSpec, file: ResumeFile, field: str) -> None:
    """The builtin and factory trainer resume `fsdp` from a DCP folder and every other mode from
    a file (contract §5, §11): the other kind would fail in every rank at its first step, after
    the job waited for GPUs. A script reads what it likes."""
    if spec.entrypoint.kind not in ("builtin", "factory"):
        return
    wants = "folder" if spec.mode == "fsdp" else "file"
    if file.kind != wants:
        shape = "a DCP folder (an fsdp job's)" if wants == "folder" else "a checkpoint file"
        raise InvalidSpec(
            ("resume_from", field),
            f"mode {spec.mode!r} of the {spec.entrypoint.kind} trainer resumes from {shape}; "
            f"checkpoint {file.id} is a {file.kind}",
        )


def validate_in_context(
    session: Session,
    settings: Settings,
    storage: Storage,
    spec: JobSpec,
    user: User,
    cluster: Cluster | None = None,
) -> int | None:
    """The checks in their order (the first failure is the answer); `cluster`: the hosts as
    the caller holds them, or None to read them."""
    if spec.code is not None:
        check_code(session, spec, user)
    elif isinstance(spec.entrypoint, ScriptEntrypoint):
        resolve_script(spec.entrypoint.path, settings.script_root_paths)
    check_fits_cluster(session, spec, cluster)
    check_owner_limits(spec, user)
    check_dependencies(session, spec, user)
    check_amp(session, spec, cluster)
    return resolve_resume(session, settings, storage, spec, user)
