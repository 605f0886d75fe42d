"""The `torchjobs worker` process: announce the host, heartbeat, consume its own queue.

Each worker consumes only `worker.<name>`, so the scheduler's placement decides exactly which
host runs which node. Concurrency is one thread per GPU slot: a node task mostly waits on its
torchrun process. On shutdown the running nodes are stopped (their ranks get SIGTERM and
checkpoint) and reported as lost, so their jobs retry where retries are allowed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import tempfile
import threading
import uuid
from pathlib import Path

from celery import Celery, signals
from sqlalchemy.exc import OperationalError

from service.config import Settings
from service.db import Database, unavailable_reason
from service.models import utcnow
from service.nodes import exec_link, hosts
from service.nodes.wire import queue_for
from service.storage import Storage
from workers import context, exec_endpoint
from workers.celery_app import make_celery
from workers.code_cache import sweep_staging
from workers.context import WorkerContext
from workers.environments import envs_root, prepare_envs_root, remove_unsalted
from workers.launcher import cgroups, devices, dns_relay, job_network, sandbox, uids
from workers.launcher.command import NodePaths, code_folders, passthrough
from workers.launcher.jobfiles import remove_tree
from workers.launcher.procs import kill_under
from workers.launcher.readable import warn_unreadable
from workers.launcher.run_dir import remove_run_dir, tmp_root
from workers.launcher.sandbox import Isolation
from workers.launcher.sandbox_spares import SpareSandboxes
from workers.launcher.supervisor import warm_agents
from workers.launcher.uids import UidPool
from workers.tasks import register_tasks

log = logging.getLogger("torchjobs.worker")


def detect_gpus(accelerator: str) -> tuple[str, int]:
    """'auto' means CUDA when torch sees a device, else CPU slots (one per core, at least 1)."""
    import os

    if accelerator in ("auto", "cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count or accelerator == "cuda":
            return "cuda", count
    return "cpu", max(1, os.cpu_count() or 1)


def remove_stale_runs(run_root: Path) -> None:
    """Nodes of a previous process of this worker are lost anyway: stop any rank of theirs
    still running (an orphan would hold GPUs the scheduler now gives to others) and drop
    what they left."""
    killed = kill_under(str(run_root) + "/")
    if killed:
        log.warning("killed %s orphaned process(es) of a previous worker process", killed)
    for run_dir in run_root.glob("job-*/attempt-*/node-*"):
        remove_run_dir(NodePaths(run_dir=run_dir, tmp_root=tmp_root()))
    remove_tree(run_root)


def register(ctx: WorkerContext) -> None:
    with ctx.db.transaction() as session:
        hosts.upsert_worker(
            session,
            name=ctx.name,
            address=ctx.address,
            accelerator=ctx.accelerator,
            gpus=ctx.gpus,
            session_id=ctx.session_id,
            now=utcnow(),
            gpu_ids=list(ctx.gpu_ids),
            isolation=ctx.isolation.kind,
            isolation_detail=ctx.isolation.detail,
            open_to_all=ctx.isolation.sandboxed or ctx.settings.allow_unisolated,
            multinode_open_to_all=multinode_open_to_all(ctx),
            meshes=ctx.meshes,
        )


def multinode_open_to_all(ctx: WorkerContext) -> bool:
    """Whether this worker takes every user's multi-node jobs: their nodes get networks of
    their own here, or the admin chose otherwise (`TORCHJOBS_JOB_NETWORK=host`,
    `TORCHJOBS_ALLOW_HOST_NETWORK`). An unsandboxed worker is closed to others as a whole
    (`open_to_all`). A normal user's worker cannot make veths: there a multi-node job's ranks
    would share the host's network, its loopback services and abstract sockets included."""
    settings = ctx.settings
    chosen = settings.job_network == "host" or settings.allow_host_network
    return ctx.node_meshes or not ctx.isolation.sandboxed or chosen


def record_admin_subnet(ctx: WorkerContext) -> None:
    """An admin's `TORCHJOBS_JOB_SUBNET` this worker hands out, recorded by the control plane
    so that the pool gives no other host a block over it; an overlap with another host's is
    said (their meshes with each other will be refused)."""
    if ctx.settings.job_subnet and ctx.job_subnet == ctx.settings.job_subnet:
        clash = hosts.claim_subnet(ctx.db, ctx.address, ctx.job_subnet)
        if clash is not None:
            log.warning("%s: multi-node jobs between the two hosts will be refused", clash)


def start_exec_endpoint(ctx: WorkerContext) -> exec_endpoint.Endpoint | None:
    """Contract §14: the endpoint the API reaches this worker's running ranks through, and
    its address and secret on this worker's row (workers/exec_endpoint.py says why)."""
    endpoint = exec_endpoint.start(ctx.settings.exec_bind, ctx.settings.exec_port, ctx.address)
    if endpoint is not None:
        with ctx.db.transaction() as session:
            exec_link.publish_endpoint(session, ctx.name, ctx.session_id, endpoint.address, endpoint.secret)
    return endpoint


def spare_sandboxes(ctx: WorkerContext) -> SpareSandboxes:
    """Warm agents each in a sandbox of their own, moved under a node when it comes (CPU
    workers: a CUDA spare would have to hold every GPU's device file)."""
    return SpareSandboxes(
        ctx.isolation,
        read_only=ctx.sandbox_read_only,
        spares_root=ctx.run_root / ".spares",
        tmp_root=Path(tempfile.gettempdir()),
        python=sys.executable,
        private_network=ctx.job_network in ("private", "routed"),
        resolv_conf=ctx.dns_conf,
        uids=ctx.uids,
        warm_ranks=ctx.settings.warm_ranks,
    )


def job_uids(iso: Isolation, settings: Settings) -> tuple[UidPool | None, Isolation]:
    """A root worker's uid pool (a uid per job node), and its isolation saying so."""
    found = uids.parse(settings.job_uids)
    if found is None or not iso.sandboxed or iso.uid is None:
        return None, iso
    detail = f"bubblewrap, each job node a uid of its own ({found.first}-{found.last}), seccomp"
    return uids.UidPool(found), dataclasses.replace(iso, detail=detail)


def announce_isolation(iso: Isolation, settings: Settings) -> None:
    """Say at start how ranks are walled off, or why they are not and what follows from it."""
    if iso.sandboxed:
        log.info("ranks run sandboxed: %s", iso.detail)
    elif settings.allow_unisolated:
        log.warning("ranks run WITHOUT a sandbox (%s); every user's jobs are taken "
                    "(TORCHJOBS_ALLOW_UNISOLATED=true)", iso.detail)  # fmt: skip
    else:
        log.warning("ranks cannot be sandboxed here (%s): this worker takes only the admin's jobs "
                    "(TORCHJOBS_ALLOW_UNISOLATED=true takes everyone's)", iso.detail)  # fmt: skip


def prepare_job_network(ctx: WorkerContext) -> None:
    """The host's side of its jobs' networks (contract §7 v3), and which one they get
    (`ctx.job_network`). `routed`: the host's rules and forwarding, or the worker does not
    start (a job must never get a weaker wall than the admin asked for). `auto`: routed where
    this worker can give it, else private, said at start. `private`: multi-node jobs' meshes
    where the worker can make them; where it cannot (not root), it says so, and their nodes
    keep the host's network."""
    mode = ctx.settings.job_network
    if mode == "auto":
        mode = "routed" if _routed_where_it_can(ctx) else "private"
    elif mode == "routed":
        if not ctx.isolation.sandboxed:
            raise SystemExit("TORCHJOBS_JOB_NETWORK=routed needs the sandbox; ranks cannot be sandboxed here")
        _prepare_routed(ctx, "TORCHJOBS_JOB_NETWORK=routed")
    ctx.job_network = mode
    if mode == "private" and ctx.isolation.sandboxed:
        _prepare_private(ctx)


def _routed_where_it_can(ctx: WorkerContext) -> bool:
    """`auto`: the routed network (the world reachable, contract §7 v3) where this worker can
    give it. Where it cannot (not root, no sandbox, no nftables), the jobs get the private
    one, which walls as much and routes nothing out: said here, once. A bad subnet or pool is
    the admin's to fix in any mode: the worker stops."""
    why_not = job_network.routed_unavailable() if ctx.isolation.sandboxed else "ranks are not sandboxed"
    if why_not is None:
        try:
            _prepare_routed(ctx, "job networks")
            return True
        except job_network.TableRefused as exc:  # a kernel without nf_tables, say: nothing written
            why_not = str(exc)
    log.warning("jobs get no route to the world here (%s): the private network "
                "(docs/security.md, Network)", why_not)  # fmt: skip
    return False


def _prepare_routed(ctx: WorkerContext, name: str) -> None:
    """The rules and forwarding. What the admin set wrong (the subnet, the pool, the opened
    ranges) stops the worker in any mode; what the host refuses stops it where routed was
    asked for, and is raised to an `auto` worker, which falls back."""
    settings = ctx.settings
    try:
        ctx.job_subnet = job_subnet(ctx)
        job_network.prepare_host(ctx.job_subnet, settings.job_network_allow)
    except job_network.TableRefused as exc:
        if settings.job_network == "auto":
            raise  # nothing written: the private network instead
        raise SystemExit(f"{name}: {exc}") from exc
    except (job_network.NetworkUnavailable, hosts.NoSubnet) as exc:  # the admin's, or half written
        raise SystemExit(f"{name}: {exc}") from exc
    ctx.node_meshes = True
    log.info("job nodes get routed networks from %s (nftables: inet torchjobs)", ctx.job_subnet)
    if settings.job_network_dns:
        start_dns_relay(ctx)


def start_dns_relay(ctx: WorkerContext) -> None:
    """Routed nodes resolve names through the worker (dns_relay.py): the host's resolvers are
    walled from jobs like any other service, and one on the host's loopback is out of reach."""
    host_conf = dns_relay.read_or_empty(dns_relay.HOST_CONF)
    servers = dns_relay.upstreams(host_conf)
    ctx.dns_conf = dns_relay.relay_conf(ctx.run_root / ".dns", host_conf)
    ctx.dns_relay = dns_relay.DnsRelay(servers)
    ctx.dns_relay.start()
    log.info("job nodes' look-ups relayed to %s", ", ".join(servers))


def _prepare_private(ctx: WorkerContext) -> None:
    why_not = job_network.private_mesh_unavailable()
    if why_not is not None:  # a normal user's worker: it cannot
        log.warning("multi-node jobs run on the host's network here (%s): they can reach what "
                    "this host can (docs/security.md, Network)", why_not)  # fmt: skip
        return
    try:  # a worker that can wall them never falls back to the host's network
        ctx.job_subnet = job_subnet(ctx)
        ctx.mesh_elements = job_network.prepare_private(ctx.job_subnet)
    except (job_network.NetworkUnavailable, hosts.NoSubnet) as exc:
        raise SystemExit(f"multi-node jobs' own networks: {exc}") from exc
    ctx.node_meshes = True
    log.info("multi-node jobs' nodes get networks of their own from %s", ctx.job_subnet)


def job_subnet(ctx: WorkerContext) -> str:
    """The admin's `TORCHJOBS_JOB_SUBNET` for this host, else the one the control plane gives."""
    if ctx.settings.job_subnet:
        return ctx.settings.job_subnet
    return hosts.subnet_of_host(
        ctx.db, ctx.address, ctx.settings.job_subnet_pool, avoid=job_network.host_subnets()
    )


class Heartbeat(threading.Thread):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(name="torchjobs-heartbeat", daemon=True)
        self.ctx = ctx
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.ctx.settings.heartbeat_interval_s):
            try:
                with self.ctx.db.transaction() as session:
                    if not hosts.heartbeat(session, self.ctx.name, self.ctx.session_id, utcnow()):
                        log.error("worker %s was taken over by another process", self.ctx.name)
            except OperationalError as exc:  # the database away: one line a beat, no traceback
                log.warning("heartbeat failed (%s); will retry", unavailable_reason(exc))
            except Exception:
                log.exception("heartbeat failed; will retry")


def _agent_env() -> dict[str, str]:
    """The waiting agent's own environment until a launch gives it the ranks': the worker's,
    without its configuration (database URL, tokens)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TORCHJOBS_")}


def run_worker(
    settings: Settings, *, name: str, gpus: int | None, accelerator: str, address: str | None
) -> None:
    kind, detected = detect_gpus(accelerator)
    db = Database(settings)
    ctx = WorkerContext(
        settings=settings,
        db=db,
        storage=Storage.from_settings(settings),
        name=name,
        session_id=uuid.uuid4().hex,
        address=address or _default_address(),
        accelerator=kind,
        gpus=gpus if gpus is not None else detected,
    )
    ctx.cgroups = cgroups.detect(name, ctx.run_root)
    if ctx.cgroups is not None and (killed := cgroups.sweep(ctx.cgroups)):
        log.warning(
            "killed %s process(es) left in job nodes' control groups by a previous worker process", killed
        )
    remove_stale_runs(ctx.run_root)  # before a spare sandbox is made there
    remove_unsalted(settings.cache_dir)
    for cache in (settings.cache_dir / "code", envs_root(settings)):
        sweep_staging(cache)  # what a killed worker was building
    ctx.isolation = sandbox.detect(settings.sandbox, settings.sandbox_user)
    ctx.uids, ctx.isolation = job_uids(ctx.isolation, settings)
    announce_isolation(ctx.isolation, settings)
    prepare_job_network(ctx)
    ctx.rank_base_env = passthrough(os.environ, settings.rank_env_allow)
    if ctx.isolation.sandboxed:  # the Python environment, script roots, a passed PYTHONPATH
        folders = code_folders(settings.script_root_paths, ctx.rank_base_env)
        envs = prepare_envs_root(envs_root(settings))  # every job reads its own, lists none, writes none
        ctx.sandbox_read_only = (
            *sandbox.python_paths(sys.executable),
            *folders,
            str(envs),
            *settings.sandbox_bind_paths,  # the admin's: NCCL network plugins and their libraries
        )
        warn_unreadable(ctx.isolation, settings, ctx.rank_base_env, ctx.sandbox_read_only, sys.executable)
    if kind == "cuda":
        ctx.gpu_ids = devices.slot_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), ctx.gpus)
        ctx.host_gpus = devices.nvidia_gpus()
    else:
        ctx.gpu_ids = tuple(str(i) for i in range(ctx.gpus))
    # a CPU worker's slots are the cores a spare's torch import would take from its jobs
    ctx.agents = warm_agents(
        _agent_env(),
        enabled=settings.warm_agent and (kind == "cpu" or not ctx.isolation.sandboxed),
        spawn_when_idle=kind == "cpu",
        sandboxes=spare_sandboxes(ctx) if ctx.isolation.sandboxed else None,
    )
    context.set_current(ctx)
    register(ctx)
    record_admin_subnet(ctx)
    endpoint = start_exec_endpoint(ctx)
    beat = Heartbeat(ctx)
    beat.start()
    app = make_celery(settings)
    register_tasks(app)

    if settings.log_json:
        _celery_logs_json()

    @signals.worker_shutting_down.connect
    def _on_shutdown(**_: object) -> None:
        ctx.shutdown.set()

    log.info("worker %s: %s x%s at %s", name, ctx.accelerator, ctx.gpus, ctx.address)
    try:
        code = _run_celery_worker(
            app,
            [
                *(["--quiet"] if settings.log_json else []),  # no banner: every line stays JSON
                "worker",
                "-Q",
                queue_for(name),
                "-P",
                "threads",
                "-c",
                str(max(1, ctx.gpus)),
                "-n",
                f"{name}@{socket.gethostname()}",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
            ],
        )
    finally:
        _stop_worker(ctx, beat, endpoint)
    if code:
        raise SystemExit(code)


def _stop_worker(ctx: WorkerContext, beat: Heartbeat, endpoint: exec_endpoint.Endpoint | None) -> None:
    ctx.shutdown.set()
    beat.stopped.set()
    if endpoint is not None:
        endpoint.stop()
    if ctx.agents is not None:
        ctx.agents.close()
    if ctx.dns_relay is not None:
        ctx.dns_relay.stop()
    with ctx.db.transaction() as session:
        hosts.mark_offline(session, ctx.name, ctx.session_id)
    ctx.db.dispose()


def _run_celery_worker(app: Celery, argv: list[str]) -> int:
    """`app.worker_main(argv)`, keeping the exit status that it (and `app.start`) drops.

    After an "Unrecoverable error" Celery stops with status 1, and whoever restarts workers
    (`up`, systemd, a pod) must see a failure, not a clean stop. This is `Celery.start` with
    the status that click returns under `standalone_mode=False` kept.
    """
    from celery.bin.celery import celery as celery_cli

    celery_cli.params[0].default = app  # the --app option, as Celery.start sets it
    try:
        code = celery_cli.main(args=argv, standalone_mode=False)
    finally:
        celery_cli.params[0].default = None
    return code if isinstance(code, int) else 0


def _celery_logs_json() -> None:
    """Celery leaves logging alone when someone handles `setup_logging`, and its few direct
    writes to the terminal (shutdown notices) become log records: every line stays JSON."""
    import celery.apps.worker as celery_worker

    signals.setup_logging.connect(lambda **_: None, weak=False)
    celery_worker.safe_say = lambda msg, f=None: logging.getLogger("celery.worker").warning(str(msg).strip())


def _default_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
