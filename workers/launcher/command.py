"""Turn one placed node into a torchrun argv, environment and working folder — no side effects.

Like torchrun's own `config_from_args`, the whole launch is computed first by this pure
function (and unit-tested exhaustively), and only then acted on by the supervisor.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Variables of the worker's own environment that never reach a rank: our configuration
# (database URL, tokens) and anything torchrun or the loader must set by itself.
_STRIP_PREFIXES = ("TORCHJOBS_", "TORCHELASTIC_", "MASTER_", "LOCAL_", "CELERY_")
_STRIP_NAMES = {"RANK", "WORLD_SIZE", "GROUP_RANK", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD"}


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
    base_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("single", "dp", "ddp"):
            raise ValueError(f"unknown mode {self.mode!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError("node_rank outside [0, nnodes)")
        if not self.gpus:
            raise ValueError("a node needs at least one GPU slot")
        if self.entrypoint.get("kind") == "script" and not self.script_path:
            raise ValueError("a script entrypoint needs its resolved path")


@dataclass(frozen=True, kw_only=True)
class NodePaths:
    run_dir: Path
    tmp_root: Path = Path("/tmp")

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def events(self) -> Path:
        return self.run_dir / "events.jsonl"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def tmp(self) -> Path:
        """TMPDIR of the ranks: short on purpose. Unix sockets (DataLoader workers, torch's
        multiprocessing) live there and their paths may not pass 107 bytes, which a deep
        TORCHJOBS_HOME easily would. `run_dir/tmp` links to it, so cleanup can find it."""
        digest = hashlib.sha256(str(self.run_dir).encode()).hexdigest()[:12]
        return self.tmp_root / f"torchjobs-{digest}"

    @property
    def tmp_link(self) -> Path:
        return self.run_dir / "tmp"

    @property
    def config(self) -> Path:
        return self.run_dir / "config.json"

    @property
    def agent_log(self) -> Path:
        return self.run_dir / "agent.log"


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    paths: NodePaths
    config: dict[str, Any] | None


def processes_per_node(mode: str, gpus: int) -> int:
    """DDP runs one process per GPU; single and DataParallel run one process per node."""
    return gpus if mode == "ddp" else 1


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
        f"--log-dir={paths.logs}",
        "--redirects=3",
        "--max-restarts=0",
        "--monitor-interval=0.1",  # torchrun's default: a rank's exit is seen within 0.1 s
    ]
    config = None
    if launch.entrypoint.get("kind") == "script":
        assert launch.script_path is not None
        argv += ["-m", "workers.runtime.script", launch.script_path, *launch.entrypoint.get("args", [])]
    else:
        config = trainer_config(launch)
        argv += ["-m", "workers.runtime.train", "--config", str(paths.config)]
    return LaunchPlan(argv=argv, env=rank_env(launch, paths), cwd=launch.run_dir, paths=paths, config=config)


def rank_env(launch: NodeLaunch, paths: NodePaths) -> dict[str, str]:
    env = {
        k: v
        for k, v in launch.base_env.items()
        if not k.startswith(_STRIP_PREFIXES) and k not in _STRIP_NAMES
    }
    env.update(launch.user_env)
    env.update(
        TORCHJOBS_JOB_ID=str(launch.job_id),
        TORCHJOBS_ATTEMPT=str(launch.attempt),
        TORCHJOBS_CHECKPOINT_DIR=str(paths.checkpoints),
        TORCHJOBS_EVENTS=str(paths.events),
        TORCHJOBS_ACCELERATOR=launch.accelerator,
        TORCHJOBS_PREFLIGHT_TIMEOUT_S=f"{launch.preflight_timeout_s:g}",
        TMPDIR=str(paths.tmp),
        PYTHONUNBUFFERED="1",
    )
    if launch.resume_path:
        env["TORCHJOBS_RESUME_FROM"] = launch.resume_path
    if launch.accelerator == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in launch.gpus)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["TORCHJOBS_SLOTS"] = ",".join(str(g) for g in launch.gpus)
    return env


def config_json(plan: LaunchPlan) -> str:
    return json.dumps(plan.config, indent=2, sort_keys=True)
