"""The warm torchrun agent: a launch handed to it runs exactly as a cold torchrun would (same
ranks, environment, folder, output file, exit status), and the pool keeps one ready."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.testing.harness import free_port
from workers.launcher.agents import WarmAgentPool
from workers.launcher.procs import pids_under
from workers.launcher.supervisor import cold_agents, warm_agents

SCRIPT = """
import os, sys, time
# one write per line: with PYTHONUNBUFFERED each argument of a print() is its own write, and
# the two ranks share the agent's output file, so their words could interleave
env = os.environ
line = f"rank {env['RANK']} of {env['WORLD_SIZE']} flag {env.get('MY_FLAG')} cwd {os.getcwd()}\\n"
sys.stdout.write(line)
sys.stdout.flush()
if os.environ.get("SLEEP"):
    time.sleep(float(os.environ["SLEEP"]))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def _launch(pool: WarmAgentPool, tmp_path: Path, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    log = run / "agent.log"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--monitor-interval=0.2",
        str(script),
    ]
    base = {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return pool.start(argv, {**base, **env}, run, log), log


def _wait_ready(pool: WarmAgentPool) -> None:
    deadline = time.monotonic() + 30
    while not pool.ready():
        assert time.monotonic() < deadline, "no warm agent started"
        time.sleep(0.05)


@pytest.fixture
def pool() -> WarmAgentPool:
    pool = warm_agents({"PATH": "/usr/bin:/bin"}, enabled=True)
    yield pool
    pool.close()


def test_a_warm_launch_runs_the_ranks_with_the_launch_env(
    pool: WarmAgentPool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _wait_ready(pool)
    proc, log = _launch(pool, tmp_path, MY_FLAG="on")
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    out = log.read_text()
    run = str(tmp_path / "run")
    for rank in (0, 1):
        assert f"rank {rank} of 2 flag on cwd {run}" in out, out[-3000:]
    assert (pool.warm_starts, pool.cold_starts) == (1, 0), caplog.text
    _wait_ready(pool)  # and the next one is already waiting


def test_a_failing_rank_fails_the_warm_agent_as_it_fails_a_cold_one(
    pool: WarmAgentPool, tmp_path: Path
) -> None:
    _wait_ready(pool)
    warm, warm_log = _launch(pool, tmp_path / "warm", EXIT="3")
    cold, cold_log = _launch(cold_agents(), tmp_path / "cold", EXIT="3")
    assert warm.wait(timeout=120) == cold.wait(timeout=120) != 0
    for log in (warm_log, cold_log):
        assert "Root Cause (first observed failure)" in log.read_text()
        assert "exitcode  : 3" in log.read_text()


def test_a_running_warm_agent_is_found_under_its_run_folder(pool: WarmAgentPool, tmp_path: Path) -> None:
    _wait_ready(pool)
    proc, _ = _launch(pool, tmp_path, SLEEP="30")
    try:
        deadline = time.monotonic() + 30
        while proc.pid not in pids_under(str(tmp_path / "run") + "/"):
            assert time.monotonic() < deadline, "the warm agent is not found by its folder"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


def test_without_a_warm_agent_launches_start_cold(tmp_path: Path) -> None:
    pool = cold_agents()
    proc, log = _launch(pool, tmp_path)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert (pool.warm_starts, pool.cold_starts) == (0, 1)


def test_closing_the_pool_ends_its_waiting_agent(tmp_path: Path) -> None:
    pool = warm_agents({"PATH": "/usr/bin:/bin"}, enabled=True)
    _wait_ready(pool)
    spare = pool._spare
    assert spare is not None
    pool.close()
    spare.wait(timeout=30)  # EOF on its input, or the SIGTERM of its spawner thread ending


def test_on_a_cpu_worker_the_next_spare_waits_until_no_node_runs(tmp_path: Path) -> None:
    """Its torch import would take a core from the job's own ranks (a CPU worker's slots)."""
    pool = warm_agents({"PATH": "/usr/bin:/bin"}, enabled=True, spawn_when_idle=True)
    try:
        _wait_ready(pool)  # idle at start: the first spare comes at once
        with pool.node_running():
            proc, log = _launch(pool, tmp_path, SLEEP="1")
            assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
            assert not pool.ready()  # taken, and no replacement while a node runs
        _wait_ready(pool)  # one as soon as none does
        assert (pool.warm_starts, pool.cold_starts) == (1, 0)
    finally:
        pool.close()


def _stuck_spare() -> subprocess.Popen[bytes]:
    """A "warm agent" that never reads its launch: hung in an import, say."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )


def test_a_warm_agent_that_does_not_take_its_launch_is_killed_and_the_launch_starts_cold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spares: list[subprocess.Popen[bytes]] = []

    def spawn() -> tuple[subprocess.Popen[bytes], None]:
        spares.append(_stuck_spare())
        return spares[-1], None

    pool = WarmAgentPool({"PATH": "/usr/bin:/bin"}, enabled=True, handoff_timeout_s=1.0)
    monkeypatch.setattr(pool, "_spawn", spawn)
    pool.begin()
    try:
        _wait_ready(pool)
        proc, log = _launch(pool, tmp_path, MY_FLAG="cold")
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert "flag cold" in log.read_text()
        assert (pool.warm_starts, pool.cold_starts) == (0, 1)
        assert spares[0].poll() is not None  # not left waiting on its pipe
    finally:
        pool.close()
