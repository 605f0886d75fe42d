"""The identity and handles of one worker process, built once at start and passed to tasks."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from service.config import Settings
from service.db import Database
from service.storage import Storage
from workers.launcher.agents import WarmAgentPool
from workers.launcher.cgroups import Hierarchy
from workers.launcher.devices import Gpu
from workers.launcher.dns_relay import DnsRelay
from workers.launcher.sandbox import UNISOLATED, Isolation
from workers.launcher.uids import UidPool


@dataclass(kw_only=True)
class WorkerContext:
    settings: Settings
    db: Database
    storage: Storage
    name: str
    session_id: str
    address: str
    accelerator: str
    gpus: int
    shutdown: threading.Event = field(default_factory=threading.Event)
    agents: WarmAgentPool | None = None  # the warm torchrun agent, when the worker keeps one
    isolation: Isolation = UNISOLATED  # how ranks are walled off (probed at start)
    gpu_ids: tuple[str, ...] = ()  # the physical GPU behind each slot (launcher/devices.py)
    host_gpus: tuple[Gpu, ...] = ()  # what nvidia-smi says of this host's GPUs
    rank_base_env: dict[str, str] = field(default_factory=dict)  # the worker's variables ranks get
    sandbox_read_only: tuple[str, ...] = ()  # what every sandbox of this worker binds read-only
    uids: UidPool | None = None  # a uid per job node (a root worker's sandbox), else None
    cgroups: Hierarchy | None = None  # where each node's control groups are made (None: none)
    # the network its job nodes get: settings.job_network, "auto" resolved at start (agent.py)
    job_network: str = "private"
    # this host's job subnet (routed, or a private mesh), and whether a multi-node job's nodes
    # get networks of their own (workers/node_mesh.py; else they keep the host's)
    job_subnet: str | None = None
    node_meshes: bool = False
    mesh_elements: bool = False  # a private mesh's nftables elements too (job_network.mesh_elements)
    # a routed worker's look-ups for its nodes (TORCHJOBS_JOB_NETWORK_DNS): the relay, and the
    # resolv.conf its sandboxes bind that names it
    dns_relay: DnsRelay | None = None
    dns_conf: Path | None = None

    @property
    def meshes(self) -> bool:
        """Whether a multi-node job's nodes get networks of their own here (node_mesh.py)."""
        return self.node_meshes and self.isolation.sandboxed

    @property
    def run_root(self) -> Path:
        """This worker's run folders; whatever a previous process left here is dead."""
        return self.settings.runs_dir / self.name


_current: WorkerContext | None = None


def set_current(ctx: WorkerContext) -> None:
    global _current
    _current = ctx


def current() -> WorkerContext:
    if _current is None:
        raise RuntimeError("this process is not a torchjobs worker")
    return _current
