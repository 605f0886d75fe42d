"""Fixtures for the runtime's tests: launching the real trainer under the real torchrun.

Every launch is `python -m torch.distributed.run ... -m workers.runtime.trainer.train --config FILE`,
the exact command the platform's worker runs, on CPU with gloo and one thread per process.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from service.testing import harness

REPO = Path(__file__).resolve().parents[3]

# Small enough for 2 CPU cores: 512 samples, 32 per batch -> 16 steps per epoch alone, 8 per rank in DDP.
BASE_CONFIG: dict[str, Any] = {
    "mode": "single",
    "accelerator": "cpu",
    "gpus_per_node": 1,
    "entrypoint": {"kind": "builtin", "model": "cnn", "dataset": "synthetic"},
    "hyperparameters": {
        "epochs": 4,
        "batch_size": 32,
        "lr": 0.01,
        "weight_decay": 0.001,
        "optimizer": "adamw",
        "seed": 3,
        "num_workers": 0,
        "checkpoint_every": 1,
        "synthetic_size": 512,
        "report_every": 4,
    },
}


def make_config(mode: str = "single", **hyper: Any) -> dict[str, Any]:
    config = copy.deepcopy(BASE_CONFIG)
    config["mode"] = mode
    config["hyperparameters"].update(hyper)
    return config


def free_port() -> int:
    """Below the kernel's ephemeral range (harness.free_port): a port bound to 0 is one the
    kernel may hand to the next outgoing connection (EADDRINUSE for torchrun's store, seen
    with two test processes)."""
    return harness.free_port()


def child_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any rank or TORCHJOBS_ variables of its own."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHJOBS_", "TORCHELASTIC_", "MASTER_"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), extra.pop("PYTHONPATH", "")]))
    env.update(extra)
    return env


@dataclass
class Run:
    """One launched job: its folders and, once finished, its exit code and output."""

    dir: Path
    proc: subprocess.Popen[str]
    returncode: int | None = None
    output: str = ""

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"

    @property
    def events_path(self) -> Path:
        return self.dir / "events.jsonl"

    def all_events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines() if line.endswith("}")]

    def events(self) -> list[dict[str, Any]]:
        """The progress reports (the trainer also announces each checkpoint file)."""
        return [e for e in self.all_events() if e.get("type") == "progress"]

    def checkpoint_events(self) -> list[dict[str, Any]]:
        return [e for e in self.all_events() if e.get("type") == "checkpoint"]

    def wait(self, timeout: float = 180) -> Run:
        try:
            self.output, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.output, _ = self.proc.communicate()
            raise AssertionError(f"run in {self.dir} timed out:\n{self.output[-4000:]}") from None
        self.returncode = self.proc.returncode
        return self

    def ok(self) -> Run:
        self.wait()
        assert self.returncode == 0, f"exit {self.returncode}:\n{self.output[-6000:]}"
        return self

    def wait_for_event(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(predicate(e) for e in self.events()):
                return
            assert self.proc.poll() is None, f"run ended early:\n{self.proc.communicate()[0][-4000:]}"
            time.sleep(0.005)
        raise AssertionError("no matching progress event in time")

    def latest_checkpoint(self) -> Path:
        files = sorted(self.checkpoints.glob("*.pt"), key=lambda p: torch.load(p, weights_only=True)["step"])
        assert files, f"no checkpoint in {self.checkpoints}"
        return files[-1]


def start(
    run_dir: Path,
    config: dict[str, Any],
    *,
    nproc: int = 1,
    resume: Path | None = None,
    torchrun: bool = True,
    **env_extra: str,
) -> Run:
    """Start a job in its own process group (as the platform's supervisor does)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    config_path.write_text(json.dumps(config))
    env = child_env(
        TORCHJOBS_JOB_ID="1",
        TORCHJOBS_CHECKPOINT_DIR=str(run_dir / "checkpoints"),
        TORCHJOBS_EVENTS=str(run_dir / "events.jsonl"),
        **env_extra,
    )
    if resume is not None:
        env["TORCHJOBS_RESUME_FROM"] = str(resume)
    trainer = ["-m", "workers.runtime.trainer.train", "--config", str(config_path)]
    argv = [sys.executable, *trainer]
    if torchrun:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--node-rank=0",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "--monitor-interval=0.2",
            *trainer,
        ]
    proc = subprocess.Popen(
        argv,
        cwd=run_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return Run(dir=run_dir, proc=proc)


def final_weights(run: Run) -> dict[str, torch.Tensor]:
    return torch.load(run.latest_checkpoint(), weights_only=True)["state_dict"]["net"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if atol == 0.0:
            assert torch.equal(a[name], b[name]), f"{name} differs"
        else:
            torch.testing.assert_close(a[name], b[name], rtol=0.0, atol=atol, msg=f"{name} differs")


class Jobs:
    """The helpers above, handed to tests as the `jobs` fixture (test modules do not import
    conftest, whose module name is shared with every other conftest in the tree)."""

    Run = Run
    config = staticmethod(make_config)
    start = staticmethod(start)
    final_weights = staticmethod(final_weights)
    assert_same_weights = staticmethod(assert_same_weights)
    child_env = staticmethod(child_env)
    repo = REPO


@pytest.fixture(scope="session")
def jobs() -> Jobs:
    return Jobs()
