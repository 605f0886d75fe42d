"""Turn one placed node into a torchrun argv, environment and the paths of its run folder — no
side effects.

Like torchrun's own `config_from_args`, the whole launch is computed first by this pure
function (and unit-tested exhaustively), and only then acted on: the run folder by run_dir.py,
the processes by the supervisor.
"""

from __future__ import annotations

import hashlib
import os
import pwd
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, overload

from workers.launcher.job_network import Attached
from workers.launcher.sandbox import (
    ENV_FILE,
    RUN_DIR,
    UNISOLATED,
    Isolation,
    Mounts,
    inside_resume_path,
    wrap,
)

# Never passed from the worker's environment, whatever the administrator's allow-list says:
# our configuration (database URL, tokens), cloud credentials, and what torchrun sets itself.
_NEVER_PREFIXES = ("TORCHJOBS_", "TORCHELASTIC_", "MASTER_", "LOCAL_", "CELERY_", "AWS_", "GOOGLE_", "AZURE_")
_NEVER_NAMES = {
    "RANK", "WORLD_SIZE", "GROUP_RANK", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "HOME", "TMPDIR",
    "USER", "LOGNAME",
}  # fmt: skip
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True, kw_only=True)
class NodeLaunch:
    job_id: int
    attempt: int
    node_rank: int
    nnodes: int
    mode: str
    gpus: tuple[int, ...]
    accelerator: str
    master_addr: str
    master_port: int
    entrypoint: Mapping[str, Any]
    hyperparameters: Mapping[str, Any] | None
    script_path: str | None
    run_dir: Path
    python: str
    rendezvous_timeout_s: int = 120
    preflight_timeout_s: float = 60.0
    tmp_root: Path = Path("/tmp")
    resume_path: str | None = None
    user_env: Mapping[str, str] = field(default_factory=dict)
    # the worker's variables that the administrator lets through (passthrough()), and LANG
    base_env: Mapping[str, str] = field(default_factory=dict)
    isolation: Isolation = UNISOLATED
    read_only: tuple[str, ...] = ()  # inside a sandbox: the Python environment, script roots
    devices: tuple[str, ...] = ()  # inside a sandbox: the node's GPU device files
    device_ids: tuple[str, ...] = ()  # the physical GPUs of `gpus` (devices.slot_ids); default the same
    code_dir: Path | None = None  # the job's unpacked code (contract §6), copied into the node's workdir
    site_first: str | None = None  # the job's built environment.pip, first on the ranks' PYTHONPATH
    # how many slots the worker has (CPU: its cores are shared out among them); 0: not told
    worker_slots: int = 0
    private_network: bool = False  # (sandboxed, single-node) a network namespace of its own
    routed_subnet: str | None = None  # ...with a routed veth from this subnet (job_network.py)
    resolv_conf: Path | None = None  # ...whose look-ups go to the worker's relay (dns_relay.py)
    # a multi-node job's node in its own network: its veth, made before the launch (node_mesh.py),
    # and its nodes' addresses with a name each, for the sandbox's /etc/hosts
    veth: Attached | None = None
    mesh_hosts: tuple[tuple[str, str], ...] = ()
    # contract §12: what torchrun waits between the SIGTERM it forwards and its SIGKILL (its
    # own default, 30 s, would cut a multi-GB checkpoint written in the job's grace)
    stop_grace_s: int = 120

    def __post_init__(self) -> None:
        if self.mode not in ("single", "dp", "ddp", "fsdp"):
            raise ValueError(f"unknown mode {self.mode!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError("node_rank outside [0, nnodes)")
        if not self.gpus:
            raise ValueError("a node needs at least one GPU slot")
        if self.worker_slots and max(self.gpus) >= self.worker_slots:
            raise ValueError(f"slots {self.gpus} outside the worker's {self.worker_slots}")
        if self.entrypoint.get("kind") == "script" and not (self.script_path or self.code_dir):
            raise ValueError("a script entrypoint needs its resolved path, or the job's code")


class InRunDir:
    """A path property: `name` inside the node's `run_dir` (one line per file, not four)."""

    def __init__(self, name: str, doc: str | None = None) -> None:
        self.name, self.__doc__ = name, doc

    @overload
    def __get__(self, obj: None, owner: type) -> InRunDir: ...
    @overload
    def __get__(self, obj: NodePaths, owner: type) -> Path: ...
    def __get__(self, obj: NodePaths | None, owner: type) -> Path | InRunDir:
        return self if obj is None else obj.run_dir / self.name


@dataclass(frozen=True, kw_only=True)
class NodePaths:
    """Where a node's files are, all under `run_dir` but the ranks' TMPDIR (see `tmp`)."""

    run_dir: Path
    tmp_root: Path = Path("/tmp")
    tmp_dir: Path | None = None  # TMPDIR as given (a sandbox's /tmp), else derived below

    checkpoints: ClassVar[InRunDir] = InRunDir("checkpoints")
    events: ClassVar[InRunDir] = InRunDir("events.jsonl")
    logs: ClassVar[InRunDir] = InRunDir("logs")
    config: ClassVar[InRunDir] = InRunDir("config.json")
    agent_log: ClassVar[InRunDir] = InRunDir("agent.log")
    home: ClassVar[InRunDir] = InRunDir(
        "home", "the ranks' private HOME: what a library writes stays in the node"
    )
    env_file: ClassVar[InRunDir] = InRunDir(ENV_FILE)
    workdir: ClassVar[InRunDir] = InRunDir(
        "workdir", "the node's private, writable copy of the job's code: the ranks' working directory"
    )

    @property
    def tmp(self) -> Path:
        """TMPDIR of the ranks: short on purpose. Unix sockets (DataLoader workers, torch's
        multiprocessing) live there and their paths may not pass 107 bytes, which a deep
        TORCHJOBS_HOME easily would. Derived from `run_dir` alone, so cleanup finds it without
        reading anything the job could change (no link in the run folder: contract §7 v3)."""
        if self.tmp_dir is not None:
            return self.tmp_dir
        digest = hashlib.sha256(str(self.run_dir).encode()).hexdigest()[:12]
        return self.tmp_root / f"torchjobs-{digest}"


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]  # the ranks' environment
    cwd: Path
    paths: NodePaths  # on the worker's side
    config: dict[str, Any] | None
    isolation: Isolation = UNISOLATED
    owner: tuple[int, int] | None = None  # uid, gid the run folder is handed to (a root sandbox)
    inner_argv: list[str] = field(default_factory=list)  # in a sandbox: what bwrap runs (cold)
    torchrun_argv: list[str] = field(default_factory=list)  # ...of which torchrun's own command line
    # a node whose veth comes from outside: (seconds, peers) its torchrun waits for (ROUTES_UP)
    routes: tuple[float, int] | None = None
    resume: str | None = None  # the resume file, on the worker's side
    code_dir: Path | None = None  # the job's unpacked code, copied to `paths.workdir` by prepare()
    private_network: bool = False  # its sandbox has a network namespace of its own
    routed_subnet: str | None = None  # and the worker plumbs a routed veth into it (job_network.py)
    veth: Attached | None = None  # that veth, made beforehand (a routed multi-node job's node)
    hosts: tuple[tuple[str, str], ...] = ()  # its nodes' addresses, for its /etc/hosts (write_hosts)

    @property
    def sandboxed(self) -> bool:
        return self.isolation.sandboxed

    @property
    def process_env(self) -> dict[str, str]:
        """What the started process itself gets: in a sandbox, bwrap gets nothing of the job's
        (the ranks' environment travels in `paths.env_file`)."""
        return {"PATH": SYSTEM_PATH} if self.sandboxed else self.env


def environment_log_of(run_dir: Path) -> Path:
    """The node's environment build output, beside its run folder (a warm sandbox's folder is
    renamed into place at launch, after the build): every rank's log starts with it."""
    return run_dir.with_name(run_dir.name + ".environment.log")


def identity_dir_of(run_dir: Path) -> Path:
    """The node's /etc/passwd and /etc/group (sandbox.write_identity), beside its run folder:
    the worker's, not the job's to change."""
    return run_dir.with_name(run_dir.name + ".identity")


def resume_dir_of(run_dir: Path) -> Path:
    """Where a warm sandbox's read-only /resume folder lives once it runs a node: beside the
    run folder (not in it: that one is writable inside), removed with it."""
    return run_dir.with_name(run_dir.name + ".resume")


def processes_per_node(mode: str, gpus: int) -> int:
    """DDP and FSDP run one process per GPU; single and DataParallel run one process per node."""
    return gpus if mode in ("ddp", "fsdp") else 1


def run_id(job_id: int, attempt: int) -> str:
    return f"torchjobs-{job_id}-{attempt}"


def trainer_config(launch: NodeLaunch) -> dict[str, Any]:
    return {
        "mode": launch.mode,
        "accelerator": launch.accelerator,
        "gpus_per_node": len(launch.gpus),
        "entrypoint": dict(launch.entrypoint),
        "hyperparameters": dict(launch.hyperparameters or {}),
    }


def build_launch(launch: NodeLaunch) -> LaunchPlan:
    paths = NodePaths(run_dir=launch.run_dir, tmp_root=launch.tmp_root)
    seen = NodePaths(run_dir=RUN_DIR, tmp_dir=Path("/tmp")) if launch.isolation.sandboxed else paths
    nproc = processes_per_node(launch.mode, len(launch.gpus))
    argv = [
        launch.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={launch.nnodes}",
        f"--node-rank={launch.node_rank}",
        f"--nproc-per-node={nproc}",
        f"--master-addr={launch.master_addr}",
        f"--master-port={launch.master_port}",
        f"--rdzv-conf=timeout={launch.rendezvous_timeout_s}",
        f"--rdzv-id={run_id(launch.job_id, launch.attempt)}",
        f"--log-dir={seen.logs}",
        "--redirects=3",
        "--max-restarts=0",
        "--monitor-interval=0.1",  # torchrun's default: a rank's exit is seen within 0.1 s
        f"--shutdown-timeout={launch.stop_grace_s}",
    ]
    config = None
    if launch.entrypoint.get("kind") == "script":
        script = str(seen.workdir / launch.entrypoint["path"]) if launch.code_dir else launch.script_path
        assert script is not None
        argv += ["-m", "workers.runtime.script", script, *launch.entrypoint.get("args", [])]
    else:
        config = trainer_config(launch)
        argv += ["-m", "workers.runtime.trainer.train", "--config", str(seen.config)]
    env = rank_env(launch, seen)
    torchrun = argv
    routes = (float(launch.rendezvous_timeout_s), awaited_routes(launch)) if meets_over_veth(launch) else None
    if routes is not None:
        argv = [launch.python, "-S", "-I", "-c", AWAIT_ROUTE, str(launch.rendezvous_timeout_s),
                str(routes[1]), "--", *argv]  # fmt: skip
    if not launch.isolation.sandboxed:
        return LaunchPlan(
            argv=argv, env=env, cwd=launch.run_dir, paths=paths, config=config, code_dir=launch.code_dir
        )
    mounts = Mounts(
        run_dir=paths.run_dir,
        tmp_dir=paths.tmp,
        resume=launch.resume_path,
        read_only=launch.read_only,
        devices=launch.devices,
        private_network=in_own_network(launch),
        identity=identity_dir_of(launch.run_dir) if launch.isolation.uid is not None else None,
        hosts=bool(launch.mesh_hosts) and launch.isolation.uid is not None,
        resolv_conf=launch.resolv_conf if in_own_network(launch) else None,
    )
    iso = launch.isolation
    return LaunchPlan(
        argv=wrap(argv, iso, mounts, launch.python),
        inner_argv=argv,
        torchrun_argv=torchrun,
        routes=routes,
        resume=launch.resume_path,
        env=env,
        cwd=launch.run_dir,
        paths=paths,
        config=config,
        isolation=iso,
        owner=iso.owner,
        code_dir=launch.code_dir,
        private_network=mounts.private_network,
        routed_subnet=launch.routed_subnet if mounts.private_network else None,
        veth=launch.veth if mounts.private_network else None,
        hosts=launch.mesh_hosts if mounts.hosts else (),
    )


def passthrough(environ: Mapping[str, str], allowed: str) -> dict[str, str]:
    """The worker's variables an administrator lets reach ranks (`TORCHJOBS_RANK_ENV_ALLOW`:
    names, or prefixes ending in `*`), minus what never may. An allow-list, never the worker's
    environment with names taken out: a variable nobody thought of stays behind."""
    patterns = [p.strip() for p in allowed.split(",") if p.strip()]

    def allowed_name(name: str) -> bool:
        if name.startswith(_NEVER_PREFIXES) or name in _NEVER_NAMES:
            return False
        return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)

    env = {k: v for k, v in environ.items() if allowed_name(k)}
    env["LANG"] = environ.get("LANG", "C.UTF-8")
    return env


def code_folders(script_roots: Sequence[Path], passed: Mapping[str, str]) -> tuple[str, ...]:
    """What a sandbox binds read-only besides the Python environment: the script roots, and
    the folders of a PYTHONPATH the administrator passes to ranks (factory modules)."""
    return (*map(str, script_roots), *filter(None, passed.get("PYTHONPATH", "").split(":")))


# The host's interface names for gloo, NCCL and TensorPipe: in a job's own network namespace
# (a single-node job) no such interface exists, and gloo fails to start ("Unable to find address
# for: eth1"). The job's own `env` may still name one of its namespace's.
HOST_INTERFACE_VARS = frozenset({"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"})


def in_own_network(launch: NodeLaunch) -> bool:
    """A sandboxed single-node job on a worker of private (or routed) job networks: its ranks
    talk over their own loopback. A multi-node job's node too where its veth was made before
    (workers/node_mesh.py); else multi-node jobs keep the host's network."""
    own = launch.nnodes == 1 or launch.veth is not None
    return launch.private_network and own and launch.isolation.sandboxed


def meets_over_veth(launch: NodeLaunch) -> bool:
    """A multi-node job's node in its own network: its ranks meet the other nodes' over `eth0`."""
    return in_own_network(launch) and launch.nnodes > 1


def awaited_routes(launch: NodeLaunch) -> int:
    """AWAIT_ROUTE's PEERS: 0 for a routed node (its default route), else its peers' count."""
    veth = launch.veth
    return 0 if veth is None or veth.gateway else len(veth.peers)


# Before torchrun, in a multi-node job's node's sandbox: the veth is moved in from outside a
# moment after the sandbox starts, and the rendezvous and gloo need it, so wait for its routes
# (job_network.move_in adds them last): a routed node's default route (PEERS 0), a private
# mesh's host route to each of its PEERS. ROUTES_UP defines `routes_up(SECONDS, PEERS)`: a cold
# node runs it first (`python -S -I -c AWAIT_ROUTE SECONDS PEERS -- ARGV...`), a warm agent
# before it takes the launch (warm_agent.py).
ROUTES_UP = (
    "import time\n"
    "def routes_up(seconds, peers):\n"
    "    deadline = time.monotonic() + seconds\n"
    "    def routed():\n"
    "        with open('/proc/net/route') as fh:\n"
    "            rows = [line.split() for line in fh.readlines()[1:]]\n"
    "        if peers == 0:\n"
    "            return any(row[1] == '00000000' for row in rows)\n"
    "        return sum(row[7] == 'FFFFFFFF' for row in rows) >= peers\n"
    "    while not routed():\n"
    "        if time.monotonic() > deadline:\n"
    "            return False\n"
    "        time.sleep(0.02)\n"
    "    return True\n"
)
AWAIT_ROUTE = ROUTES_UP + (
    "import os, sys\n"
    "if not routes_up(float(sys.argv[1]), int(sys.argv[2])):\n"
    "    sys.exit('torchjobs: the node network never came up')\n"
    "os.execv(sys.argv[4], sys.argv[4:])\n"
)


def host_network_env(passed: Mapping[str, str]) -> dict[str, str]:
    """The pass-through without the host's interface names, for a node in its own namespace."""
    return {k: v for k, v in passed.items() if k not in HOST_INTERFACE_VARS}


def rank_env(launch: NodeLaunch, paths: NodePaths) -> dict[str, str]:
    """Contract §7: PATH, a private HOME and TMPDIR, LANG, the administrator's pass-through,
    the job's own `env`, then ours (the job cannot override those)."""
    env = {"PATH": f"{Path(launch.python).parent}:{SYSTEM_PATH}"}
    env.update(host_network_env(launch.base_env) if in_own_network(launch) else launch.base_env)
    if meets_over_veth(launch):  # gloo, NCCL and TensorPipe advertise the veth's address
        env.update(dict.fromkeys(sorted(HOST_INTERFACE_VARS), "eth0"))
    env.update(launch.user_env)
    env.update(
        HOME=str(paths.home),
        TORCHJOBS_JOB_ID=str(launch.job_id),
        TORCHJOBS_ATTEMPT=str(launch.attempt),
        TORCHJOBS_CHECKPOINT_DIR=str(paths.checkpoints),
        TORCHJOBS_EVENTS=str(paths.events),
        TORCHJOBS_ACCELERATOR=launch.accelerator,
        TORCHJOBS_PREFLIGHT_TIMEOUT_S=f"{launch.preflight_timeout_s:g}",
        TMPDIR=str(paths.tmp),
        PYTHONUNBUFFERED="1",
    )
    if launch.code_dir is not None:
        env["TORCHJOBS_WORKDIR"] = str(paths.workdir)
    if launch.site_first is not None:
        env["PYTHONPATH"] = ":".join(filter(None, (launch.site_first, env.get("PYTHONPATH"))))
    if launch.resume_path:
        sandboxed = launch.isolation.sandboxed
        env["TORCHJOBS_RESUME_FROM"] = (
            inside_resume_path(launch.resume_path) if sandboxed else launch.resume_path
        )
    if launch.accelerator == "cuda":  # the worker's own devices, never bare slot numbers
        env["CUDA_VISIBLE_DEVICES"] = ",".join(launch.device_ids or [str(g) for g in launch.gpus])
        if any(d.startswith("MIG-") for d in launch.device_ids):  # one per process (runtime/mig.py)
            env["TORCHJOBS_RANK_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    # the ranks take their slots' share of the worker's cores (workers/runtime/cpus.py): pinned
    # on CPU, a thread cap on CUDA
    env["TORCHJOBS_SLOTS"] = ",".join(str(g) for g in launch.gpus)
    if launch.worker_slots:
        env["TORCHJOBS_WORKER_SLOTS"] = str(launch.worker_slots)
    env.update(USER=account_name(launch.isolation), LOGNAME=account_name(launch.isolation))
    return env


def account_name(isolation: Isolation) -> str:
    """The name the ranks' uid has in their /etc/passwd: `torchjobs` for a root worker's sandbox
    user (sandbox.write_identity), else the worker's own account (the ranks run as it). Tools that
    read USER or LOGNAME before getpwuid (getpass, some caches, `ssh`) otherwise see the
    worker's or nothing."""
    if isolation.uid is not None:
        return "torchjobs"
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return "torchjobs"
