"""`torchjobs up`: prints where to find it, and Ctrl-C stops all of it, jobs included."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from service.client.api import tls_for
from service.testing import harness
from service.testing.harness import pids_of_job, wait_event


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


SHORT = {
    "mode": "single",
    "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "synthetic"},
    "hyperparameters": {"epochs": 1, "num_workers": 0},
}


def _local_workers(stack: harness.Stack) -> list[int]:
    """The live `torchjobs worker` processes `up` started (its children; a zombie has no cmdline)."""
    up = stack.procs["up"].pid
    children = [
        int(p) for task in Path(f"/proc/{up}/task").iterdir() for p in (task / "children").read_text().split()
    ]
    return [p for p in children if b"\0worker\0" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_an_unreadable_broker_message_neither_stops_the_worker_nor_loses_work(tmp_path: Path) -> None:
    """kombu's filesystem transport wrote messages in place: a consumer could read one empty,
    and the parse error ended the local worker for good (every later job queued for ever)."""
    stack = harness.embedded_stack(tmp_path)
    try:
        [worker] = _local_workers(stack)
        queue = tmp_path / "broker" / "queue"
        (queue / f"{int(time.monotonic() * 1000)}_{'0' * 32}.worker.local.msg").write_bytes(b"")
        (queue / f"{int(time.monotonic() * 1000) + 1}_{'1' * 32}.worker.local.msg").write_bytes(b'{"body": ')
        harness.wait_for(lambda: not any(queue.glob("*.msg")), 30, "the worker to take both files")
        done = stack.wait_job(stack.submit(SHORT)["id"])
        assert done["state"] == "succeeded", done["error"]
        assert _local_workers(stack) == [worker]  # the same process: it never stopped
        assert stack.logs_of("up").count("dropped an unreadable message") == 2
    finally:
        stack.stop()


def test_a_killed_local_worker_is_started_again(tmp_path: Path) -> None:
    stack = harness.embedded_stack(tmp_path)
    try:
        [first] = _local_workers(stack)
        before = stack.worker("local")
        assert before is not None
        os.kill(first, signal.SIGKILL)
        harness.wait_for(lambda: _local_workers(stack) not in ([], [first]), 60, "a new local worker")
        stack.wait_worker_online("local", started_after=before["started_at"])
        done = stack.wait_job(stack.submit(SHORT)["id"])
        assert done["state"] == "succeeded", done["error"]
        assert "the local worker exited (code -9)" in stack.logs_of("up")
    finally:
        stack.stop()


def test_up_prints_its_url_and_token_location_on_stdout(tmp_path: Path) -> None:
    """A script reading `torchjobs up`'s standard output finds where to connect (contract §1),
    and can connect the moment it reads the line."""
    port = harness.free_port()
    proc = subprocess.Popen(
        harness.torchjobs_cmd("up", "--port", str(port), "--gpus", "1", "--accelerator", "cpu"),
        env=harness.make_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert f"torchjobs is up at http://127.0.0.1:{port}" in line and "admin token" in line, line
        assert _answers(f"http://127.0.0.1:{port}/healthz")  # said once it listens, not before
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def _answers(url: str) -> bool:
    try:
        return harness.local_get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_up_keeps_the_components_logs_out_of_the_terminal(tmp_path: Path) -> None:
    """A few clean lines on the terminal; the API's and the worker's logs (Celery's banner
    among them) in TORCHJOBS_HOME/logs, where the lines say they are."""
    port = harness.free_port()
    proc = subprocess.Popen(
        harness.torchjobs_cmd("up", "--port", str(port), "--gpus", "1", "--accelerator", "cpu"),
        env=harness.make_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    logs = tmp_path / "logs"
    try:
        harness.wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), 60, "the API")
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers=harness.auth(),
            verify=tls_for(f"http://127.0.0.1:{port}"),
        ) as c:
            harness.wait_for(lambda: c.get("/v1/workers").json()["items"], 60, "the local worker")
        harness.wait_for(lambda: "ready" in (logs / "worker.log").read_text(), 30, "the worker's log")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    lines = out.decode().splitlines()
    assert lines[0].startswith(f"torchjobs is up at http://127.0.0.1:{port}"), lines
    assert any(str(logs / "api.log") in line for line in lines), lines
    assert len(lines) <= 6, lines
    terminal = out.decode() + err.decode()
    for noise in ("celery", "[tasks]", "INFO", "SecurityWarning"):
        assert noise not in terminal, terminal
    assert "torchjobs.run_node" in (logs / "worker.log").read_text()
    assert "API up on sqlite" in (logs / "api.log").read_text()
