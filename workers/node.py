"""One node of one attempt, from claim to report: what the Celery task runs."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path

from service.db import KeptConnection
from service.errors import InvalidSpec
from service.nodes import checkpoints as node_checkpoints
from service.nodes import reports
from service.nodes.checkpoints import store_rank_checkpoint
from service.nodes.claims import Claimed, claim_for_launch, record_end
from service.nodes.code import resolve_script, storage_key
from service.nodes.values import Batch, NodeKey, NodeLimits, NodeOutcome
from service.states import NodeState
from workers import exec_endpoint, node_mesh
from workers.code_cache import CodeUnavailable, unpacked_code
from workers.context import WorkerContext
from workers.environments import EnvironmentFailed, ensure_environment
from workers.launcher.cgroups import NodeGroup, host_memory
from workers.launcher.command import NodeLaunch, NodePaths, build_launch, environment_log_of
from workers.launcher.devices import cuda_visible, device_files
from workers.launcher.run_dir import remove_run_dir, tmp_root
from workers.launcher.sandbox import Isolation
from workers.launcher.staging import StagingFailed, prune_folders, stage_folder
from workers.launcher.supervisor import FolderHooks, Hooks, NodeSupervisor

log = logging.getLogger("torchjobs.worker")


def run_node(ctx: WorkerContext, job_id: int, attempt: int, node_rank: int) -> str:
    key = NodeKey(job_id=job_id, attempt=attempt, node_rank=node_rank)
    claimed = _claim(ctx, key)
    claimed_at = time.monotonic()
    if claimed is None:
        log.info(
            "job %s attempt %s node %s: nothing to do (repeat or stale message)", job_id, attempt, node_rank
        )
        return "skipped"
    run_dir = ctx.run_root / f"job-{job_id}" / f"attempt-{attempt}" / f"node-{node_rank}"
    supervisor = mesh = None
    node_db = KeptConnection(ctx.db)
    try:
        resume = _fetch_resume(ctx, claimed.resume) if claimed.resume else None
        launch = _launch(ctx, key, claimed, run_dir, resume[0] if resume else None)
        if _meets_over_veth(ctx, launch):
            mesh = node_mesh.join(ctx, key, launch.rendezvous_timeout_s)
            launch = dataclasses.replace(
                launch, master_addr=mesh.master_address, veth=mesh.veth, mesh_hosts=mesh.hosts
            )
        supervisor = NodeSupervisor(
            key=key,
            plan=build_launch(launch),
            mode=launch.mode,
            gpus=len(launch.gpus),
            hooks=Hooks(
                write_batch=lambda b: reports.write_batch(node_db, key, b),
                record_checkpoint=lambda f, n, m, v: store_rank_checkpoint(
                    ctx.db, ctx.storage, key, f, n, m, v
                ),
                job_control=lambda: reports.job_control(ctx.db, job_id),
                node_event=lambda type_, data: reports.node_event(node_db, key, type_, data),
                peers_ended=lambda: reports.peers_ended_at(ctx.db, key),
                folders=_folder_hooks(ctx, key, launch.nnodes),
            ),
            grace_s=ctx.settings.cancel_grace_s,
            shutdown=ctx.shutdown,
            host=f"worker {ctx.name} ({ctx.address})",
            agents=ctx.agents,
            limits=_limits_now(claimed, claimed_at, ctx.settings.peer_exit_timeout_s),
            nnodes=launch.nnodes,
            log_max_bytes=int(ctx.settings.log_max_mb * 1024 * 1024),
            group=_node_group(ctx, key, len(launch.gpus)),
            disk_max_bytes=ctx.settings.job_disk_max_mb * 1024 * 1024 * len(launch.gpus),
            resume_copy=(Path(resume[0]), resume[1]) if resume else None,
            dns=ctx.dns_relay,
        )
        with exec_endpoint.NODES.running(supervisor):  # exec and forward find it (contract §14)
            outcome = supervisor.run()
    except InvalidSpec as exc:
        outcome = NodeOutcome(state=NodeState.FAILED, error=f"node {node_rank}: {exc.detail[0]['msg']}")
    except _NotReady as exc:
        outcome = NodeOutcome(state=NodeState.FAILED, error=f"node {node_rank}: {exc}")
    except node_mesh.MeshFailed as exc:
        error = f"node {node_rank} on worker {ctx.name}: {exc}"
        outcome = NodeOutcome(state=NodeState.FAILED, error=error, retryable=exc.retryable)
    except EnvironmentFailed as exc:  # not retried: the same requirements fail the same way
        _store_build_log(node_db, key, run_dir)
        outcome = NodeOutcome(state=NodeState.FAILED, error=f"environment: {exc}")
    except Exception as exc:  # the node must always report, whatever broke
        log.exception("job %s node %s crashed in the supervisor", job_id, node_rank)
        outcome = NodeOutcome(
            state=NodeState.FAILED, error=f"node {node_rank}: worker error: {exc}", retryable=True
        )
    finally:
        node_db.close()
        if mesh is not None:
            mesh.close()
    record_end(ctx.db, key, outcome, worker=ctx.name)
    node_checkpoints.end_node(ctx.db, ctx.storage, key)
    if supervisor is not None:
        supervisor.cleanup()
    else:
        remove_run_dir(NodePaths(run_dir=run_dir, tmp_root=tmp_root()))
    log.info("job %s attempt %s node %s ended: %s", job_id, attempt, node_rank, outcome.state)
    return outcome.state


def _meets_over_veth(ctx: WorkerContext, launch: NodeLaunch) -> bool:
    """A multi-node job on a worker that gives them networks of their own (node_mesh.py)."""
    return ctx.meshes and launch.nnodes > 1


def _folder_hooks(ctx: WorkerContext, key: NodeKey, nnodes: int) -> FolderHooks:
    """Folder checkpoints (contract §11) through the node seam: parts stored, node 0 lists."""
    return FolderHooks(
        store_part=lambda name, version, files, opener: node_checkpoints.store_part(
            ctx.db, ctx.storage, key, name, version, files, opener
        ),
        try_list=lambda part, meta: node_checkpoints.try_list(ctx.db, ctx.storage, key, part, nnodes, meta),
        horizon=lambda: node_checkpoints.part_horizon(ctx.db),
        note_look=lambda horizon, busy: node_checkpoints.note_look(ctx.db, key, horizon, busy),
        settle_s=ctx.settings.checkpoint_settle_s,
    )


def _node_group(ctx: WorkerContext, key: NodeKey, gpus: int) -> NodeGroup | None:
    """The node's control groups with its limits (contract §7 v3), where the host has them."""
    if ctx.cgroups is None:
        return None
    per_gpu = ctx.settings.memory_per_gpu_mb
    memory = per_gpu * 1024 * 1024 * gpus if per_gpu else host_memory() * gpus // max(1, ctx.gpus)
    name = f"job-{key.job_id}-{key.attempt}-{key.node_rank}"
    return NodeGroup.make(ctx.cgroups, name, pids_max=ctx.settings.job_pids_max, memory_bytes=memory)


def _own_uid(ctx: WorkerContext) -> Isolation:
    """The worker's isolation, with a uid of the node's own where the worker hands them out."""
    if ctx.uids is None or not ctx.isolation.sandboxed or ctx.isolation.uid is None:
        return ctx.isolation
    uid = ctx.uids.take()
    return dataclasses.replace(ctx.isolation, uid=uid, gid=uid)


def _limits_now(claimed: Claimed, claimed_at: float, peer_exit_timeout_s: float) -> NodeLimits:
    """The job's clocks and the worker's own peer timeout. The time limit counts from the
    claim: building the environment is part of the run."""
    left = claimed.limits.time_left_s
    if left is not None:
        left = max(0.0, left - (time.monotonic() - claimed_at))
    return dataclasses.replace(claimed.limits, time_left_s=left, peer_exit_timeout_s=peer_exit_timeout_s)


def _claim(ctx: WorkerContext, key: NodeKey) -> Claimed | None:
    with ctx.db.transaction() as session:
        return claim_for_launch(session, key, ctx.session_id)


class _NotReady(Exception):
    pass


def _launch(
    ctx: WorkerContext, key: NodeKey, claimed: Claimed, run_dir: Path, resume_path: str | None
) -> NodeLaunch:
    fields = claimed.launch_fields
    entry = fields["entrypoint"]
    script = code_dir = None
    if claimed.code is not None:
        code_dir = _code(ctx, claimed.code)
    elif isinstance(entry, dict) and entry.get("kind") == "script":
        script = str(resolve_script(str(entry["path"]), ctx.settings.script_root_paths))
    master_addr = str(fields.pop("master_addr"))
    if fields["nnodes"] == 1:
        master_addr = "127.0.0.1"
    gpus = fields["gpus"]
    assert isinstance(gpus, tuple)
    device_ids = cuda_visible(tuple(ctx.gpu_ids[g] for g in gpus), ctx.host_gpus) if ctx.gpu_ids else ()
    cuda_sandbox = ctx.isolation.sandboxed and ctx.accelerator == "cuda"
    return NodeLaunch(
        **fields,
        master_addr=master_addr,
        accelerator=ctx.accelerator,
        script_path=script,
        run_dir=run_dir,
        python=sys.executable,
        # a node that builds its environment may start its torchrun that much after the others
        rendezvous_timeout_s=int(
            ctx.settings.rendezvous_timeout_s + (ctx.settings.env_build_timeout_s if claimed.pip else 0)
        ),
        preflight_timeout_s=ctx.settings.preflight_timeout_s,
        resume_path=resume_path,
        tmp_root=tmp_root(),
        base_env=ctx.rank_base_env,
        isolation=_own_uid(ctx),
        read_only=ctx.sandbox_read_only,
        device_ids=device_ids,
        devices=device_files(device_ids, ctx.host_gpus) if cuda_sandbox else (),
        code_dir=code_dir,
        site_first=_environment(ctx, key, claimed.pip, run_dir) if claimed.pip else None,
        worker_slots=ctx.gpus,
        private_network=ctx.job_network in ("private", "routed"),
        routed_subnet=ctx.job_subnet if ctx.job_network == "routed" else None,
        resolv_conf=ctx.dns_conf,
    )


def _environment(ctx: WorkerContext, key: NodeKey, pip: tuple[str, ...], run_dir: Path) -> str:
    """Build (or find) the job's environment; its output waits beside the run folder for the
    ranks' logs, and two events say that the node prepared it and how long it took."""
    node = KeptConnection(ctx.db)
    try:
        reports.node_event(node, key, "environment", {"status": "preparing", "pip": list(pip)})
        log_path = environment_log_of(run_dir)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        built = ensure_environment(ctx.settings, list(pip), log_path)
        ready = {"status": "ready", "reused": built.reused, "seconds": round(built.seconds, 3)}
        reports.node_event(node, key, "environment", ready)
    finally:
        node.close()
    return str(built.site)


def _store_build_log(node_db: KeptConnection, key: NodeKey, run_dir: Path) -> None:
    """A failed build starts no rank: its output is stored as local rank 0's log."""
    path = environment_log_of(run_dir)
    if path.exists():
        reports.write_batch(node_db, key, Batch(logs=[(0, 0, path.read_bytes()[-1024 * 1024 :])]))


def _code(ctx: WorkerContext, sha: str) -> Path:
    try:
        return unpacked_code(ctx.settings, ctx.storage, sha, storage_key(sha))
    except CodeUnavailable as exc:
        raise _NotReady(str(exc)) from exc


def _fetch_resume(ctx: WorkerContext, resume: tuple[int, str, str]) -> tuple[str, str]:
    """(a verified local copy, the checkpoint's name): a file cached by content hash, a folder
    by checkpoint id (contract §11), so retries and repeats on this host fetch once."""
    ckpt_id = resume[0]
    layout = node_checkpoints.resume_layout(ctx.db, ckpt_id)
    if layout is None:
        raise _NotReady(f"checkpoint {ckpt_id} is gone")
    name, kind, files = layout
    cache = ctx.settings.cache_dir / "checkpoints"
    if kind == "folder":
        try:
            staged = stage_folder(ctx.storage, cache, ckpt_id, name, files)
        except (OSError, StagingFailed) as exc:
            raise _NotReady(f"could not fetch checkpoint {ckpt_id}: {exc}") from exc
        prune_folders(cache, ctx.settings.cache_max_bytes, keep=staged.parent)
        return str(staged), name
    return _fetch_file(ctx, resume), name


def _fetch_file(ctx: WorkerContext, resume: tuple[int, str, str]) -> str:
    ckpt_id, storage_key, sha = resume
    cache = ctx.settings.cache_dir / "checkpoints"
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{sha}.pt"
    if target.exists():
        target.touch()
        return str(target)
    partial = cache / f".{sha}.{ckpt_id}.partial"
    try:
        got = ctx.storage.download_to(storage_key, str(partial))
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise _NotReady(f"could not fetch checkpoint {ckpt_id}: {exc.__class__.__name__}") from exc
    if got != sha:
        partial.unlink(missing_ok=True)
        raise _NotReady(f"checkpoint {ckpt_id} failed its SHA-256 check")
    partial.chmod(0o644)  # readable by a sandbox's user (the cache folder itself is the worker's)
    partial.replace(target)
    prune_cache(cache, ctx.settings.cache_max_bytes, keep=target)
    return str(target)


def prune_cache(cache: Path, max_bytes: int, keep: Path) -> None:
    """Least recently used copies go first, so the cache stays under its documented bound."""
    files = sorted((p for p in cache.glob("*.pt") if p != keep), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files) + keep.stat().st_size
    for path in files:
        if total <= max_bytes:
            break
        total -= path.stat().st_size
        path.unlink(missing_ok=True)
