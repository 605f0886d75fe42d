"""`torchjobs up`: prints where to find it, and Ctrl-C stops all of it, jobs included."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests import harness
from tests.harness import pids_of_job, wait_event


def test_ctrl_c_stops_everything_cleanly(tmp_path: Path) -> None:
    stack = harness.embedded_stack(tmp_path)
    try:
        job = stack.submit(
            {
                "mode": "ddp",
                "gpus_per_node": 2,
                "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "synthetic"},
                "hyperparameters": {"epochs": 500, "num_workers": 0},
            }
        )
        wait_event(stack, job["id"], lambda e: e["type"] == "progress")
        assert pids_of_job(job["id"], stack.home)
        up = stack.procs["up"]
        started = time.monotonic()
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert time.monotonic() - started < 5 + 30  # the cancel grace (5 s here) and shutdown
        assert pids_of_job(job["id"], stack.home) == []
        log = stack.logs_of("up")
        assert f"torchjobs is up at http://127.0.0.1:{stack.port}" in log
        assert "admin token" in log
    finally:
        stack.stop()


def test_a_new_up_finds_the_interrupted_job_and_fails_or_retries_it(tmp_path: Path) -> None:
    stack = harness.embedded_stack(tmp_path)
    spec = {
        "mode": "single",
        "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "synthetic"},
        "hyperparameters": {"epochs": 2, "synthetic_size": 60000, "num_workers": 0},
        "max_retries": 1,
    }
    try:
        job = stack.submit(spec)
        wait_event(stack, job["id"], lambda e: e["type"] == "progress")
        stack.procs["up"].send_signal(signal.SIGINT)
        stack.procs.pop("up").wait(timeout=60)
        stack.start_server()
        done = stack.wait_job(job["id"], timeout=240)
        assert done["state"] == "succeeded", done["error"]
        assert done["attempt"] == 2
    finally:
        stack.stop()
