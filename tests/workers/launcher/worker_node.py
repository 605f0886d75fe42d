"""One job node run as a worker runs it, without the control plane: for the GPU suite, which
must launch through the real sandbox (issue #37), and for its CPU twin in the normal suite.

What a worker does is done here by the worker's own code: the isolation is probed as the worker
probes it (`sandbox.detect`), the slot's GPU is found in the worker's own CUDA_VISIBLE_DEVICES
(`devices.slot_ids`) and passed by UUID with only its device files bound (`cuda_visible`,
`device_files`), the plan is `build_launch`'s, and the node is carried out by the real
`NodeSupervisor`. Only the database is missing: the hooks keep in memory what a worker would
store (every log byte, every event, every checkpoint file), and the job's control answers
"running" until `stop_when` asks the node to stop as a preemption does (SIGTERM, then the grace).
"""

from __future__ import annotations

import io
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.nodes.values import Batch, JobControl, NodeKey, NodeLimits, NodeOutcome
from service.states import NodeState
from tests.workers.runtime.conftest import free_port
from workers.launcher import devices, sandbox
from workers.launcher.command import NodeLaunch, build_launch
from workers.launcher.sandbox import Isolation
from workers.launcher.supervisor import FolderHooks, Hooks, NodeSupervisor

REPO = Path(__file__).resolve().parents[3]
BUILTIN_CNN = {"kind": "builtin", "model": "cnn", "dataset": "synthetic"}


def worker_isolation() -> Isolation:
    """The sandbox a worker on this host would use (a root worker: ranks as the sandbox user).
    A host where it cannot be built fails here, naming why: the suite is about the sandbox."""
    iso = sandbox.detect("auto", "torchjobs-run")
    assert iso.sandboxed, f"no sandbox on this host: {iso.detail}"
    return iso


@dataclass
class NodeRecord:
    """What a worker would have stored of one node."""

    outcome: NodeOutcome | None = None
    logs: list[bytes] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: dict[str, bytes] = field(default_factory=dict)  # file checkpoints, by name
    folders: dict[str, dict[str, bytes]] = field(default_factory=dict)  # folder name -> path -> bytes

    @property
    def output(self) -> str:
        return b"".join(self.logs).decode(errors="replace")

    def progress(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == "progress"]

    def placements(self) -> list[str]:
        """The ranks' `placement:` log lines (workers/runtime/trainer/distributed.describe_placement)."""
        return re.findall(r"\] placement: (.*)", self.output)

    def last_checkpoint(self) -> dict[str, Any]:
        """The file checkpoint taken last, loaded."""
        assert self.checkpoints, self.output[-3000:]
        return torch.load(io.BytesIO(list(self.checkpoints.values())[-1]), weights_only=True)

    def written(self, folder: Path) -> Path:
        """The stored checkpoints laid out under `folder` as a download gives them: a file per
        file checkpoint, a folder per folder checkpoint."""
        folder.mkdir(parents=True, exist_ok=True)
        for name, blob in self.checkpoints.items():
            (folder / name).write_bytes(blob)
        for name, files in self.folders.items():
            for path, blob in files.items():
                target = folder / name / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(blob)
        return folder


def assert_succeeded(record: NodeRecord) -> None:
    assert record.outcome is not None, "the node never ended"
    assert record.outcome.state == NodeState.SUCCEEDED, (record.outcome, record.output[-4000:])


@dataclass
class NodeSpec:
    """One node of a job on a worker whose own GPU list is `worker_gpus` (its
    CUDA_VISIBLE_DEVICES entries; empty: a CPU worker) and whose slots `slots` it takes."""

    mode: str = "single"
    slots: tuple[int, ...] = (0,)
    worker_gpus: tuple[str, ...] = ()
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    entrypoint: Mapping[str, Any] = field(default_factory=lambda: BUILTIN_CNN)
    script_path: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_port: int = 0
    resume: Path | None = None
    stop_grace_s: int = 60
    time_limit_s: float = 600.0  # the job's max_duration_s: a node that hangs ends, failed


def run_node(
    tmp_path: Path,
    spec: NodeSpec,
    *,
    stop_when: Callable[[NodeRecord], bool] | None = None,
) -> NodeRecord:
    """Run the node to its end in this thread; what a worker would have stored."""
    record = NodeRecord()
    supervisor = _supervisor(tmp_path, spec, record, stop_when)
    try:
        record.outcome = supervisor.run()
    finally:
        supervisor.cleanup()
    return record


def run_nodes(tmp_path: Path, specs: list[NodeSpec]) -> list[NodeRecord]:
    """The nodes of one multi-node job, each as its own worker would run it, side by side (two
    worker processes on one host, as the two-host tests do on the CPU)."""
    records = [NodeRecord() for _ in specs]
    threads = [
        threading.Thread(target=_run_into, args=(tmp_path / f"node-{i}", spec, records[i]), daemon=True)
        for i, spec in enumerate(specs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return records


def _run_into(tmp_path: Path, spec: NodeSpec, record: NodeRecord) -> None:
    done = run_node(tmp_path, spec)
    record.__dict__.update(done.__dict__)


def launch_of(tmp_path: Path, spec: NodeSpec, iso: Isolation) -> NodeLaunch:
    """The worker's NodeLaunch for `spec` (workers/node.py `_launch`, without the claim)."""
    cuda = bool(spec.worker_gpus)
    host_gpus = devices.nvidia_gpus() if cuda else ()
    ids = tuple(spec.worker_gpus[s] for s in spec.slots) if cuda else ()
    device_ids = devices.cuda_visible(ids, host_gpus) if cuda else ()
    read_only = (*sandbox.python_paths(sys.executable),)
    return NodeLaunch(
        job_id=1,
        attempt=1,
        node_rank=spec.node_rank,
        nnodes=spec.nnodes,
        mode=spec.mode,
        gpus=spec.slots,
        accelerator="cuda" if cuda else "cpu",
        master_addr="127.0.0.1",
        master_port=spec.master_port or free_port(),
        entrypoint=dict(spec.entrypoint),
        hyperparameters=dict(spec.hyperparameters) if spec.entrypoint.get("kind") == "builtin" else None,
        script_path=spec.script_path,
        run_dir=tmp_path / "runs" / "job-1" / "attempt-1" / f"node-{spec.node_rank}",
        python=sys.executable,
        tmp_root=Path(tempfile.gettempdir()),
        resume_path=str(spec.resume) if spec.resume else None,
        base_env={"PYTHONPATH": str(REPO)},  # the worker's installed package: here the checkout
        isolation=iso,
        read_only=read_only if spec.script_path is None else (*read_only, str(Path(spec.script_path).parent)),
        devices=devices.device_files(device_ids, host_gpus) if cuda else (),
        device_ids=device_ids,
        worker_slots=len(spec.worker_gpus) if cuda else max(spec.slots) + 1,
        stop_grace_s=spec.stop_grace_s,
    )


def _supervisor(
    tmp_path: Path, spec: NodeSpec, record: NodeRecord, stop_when: Callable[[NodeRecord], bool] | None
) -> NodeSupervisor:
    iso = worker_isolation()
    launch = launch_of(tmp_path, spec, iso)
    if spec.resume is not None:  # the sandbox user reads it through its read-only bind
        for path in [spec.resume, *(spec.resume.rglob("*") if spec.resume.is_dir() else ())]:
            path.chmod(0o755 if path.is_dir() else 0o644)

    def write_batch(batch: Batch) -> JobControl:
        record.logs.extend(data for _, _, data in batch.logs)
        record.events.extend(batch.events)
        return control()

    def control() -> JobControl:
        if stop_when is not None and stop_when(record):
            return JobControl("running", 1, stop_grace_s=float(spec.stop_grace_s))  # preempted
        return JobControl("running", 1)

    def record_checkpoint(file: Any, name: str, meta: dict[str, Any] | None, version: int) -> None:
        record.checkpoints[name] = file.read()

    def store_part(name: str, version: int, files: Any, opener: Any) -> int:
        stored = record.folders.setdefault(name, {})
        for sig in files:
            source = opener(sig)
            try:
                stored[sig[0]] = source.read()
            finally:
                source.close()
        return len(record.folders)

    hooks = Hooks(
        write_batch=write_batch,
        record_checkpoint=record_checkpoint,
        job_control=control,
        folders=FolderHooks(store_part=store_part, try_list=lambda part, meta: part),
    )
    return NodeSupervisor(
        key=NodeKey(job_id=1, attempt=1, node_rank=spec.node_rank),
        plan=build_launch(launch),
        mode=spec.mode,
        gpus=len(spec.slots),
        hooks=hooks,
        grace_s=spec.stop_grace_s,
        shutdown=threading.Event(),
        nnodes=spec.nnodes,
        limits=NodeLimits(time_left_s=spec.time_limit_s, max_duration_s=int(spec.time_limit_s)),
    )


def script(tmp_path: Path, name: str, text: str) -> str:
    """A job script in a folder of its own, readable by the sandbox user (bound read-only)."""
    folder = tmp_path / "scripts"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(text)
    for p in (folder, path):
        os.chmod(p, 0o755)
    return str(path)
