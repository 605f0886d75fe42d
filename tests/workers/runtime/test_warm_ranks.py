"""Warm ranks (issue #42): a rank forked from the rank server is started exactly as
`python -u -m workers.runtime.script ...` would start it, exits and dies as it would, and
starts cold wherever a warm start could differ. A real server (torch imported, a first step
taken) and real clients, as torchrun starts them."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.launcher.sandbox_spares import COMMAND_ROOM, ROOM_BYTES, ROOM_VAR
from workers.launcher.warm_agent import CLIENT

PROBE = r"""
import json, os, random, sys, threading
import numpy, torch
with open(f"/proc/{os.getpid()}/environ", "rb") as fh:
    shown = dict(v.decode().split("=", 1) for v in fh.read().split(b"\0") if v)
with open(f"/proc/{os.getpid()}/cmdline", "rb") as fh:
    cmdline = [a.decode() for a in fh.read().split(b"\0") if a]
print(json.dumps({
    "argv": sys.argv[1:],
    "env": dict(os.environ),
    "shown_env": shown,
    "cmdline": cmdline,
    "cwd": os.getcwd(),
    "path0": sys.path[:2],
    "threads": torch.get_num_threads(),
    "python_threads": [t.name for t in threading.enumerate()],  # a loader forkserver needs one
    "policy": os.sched_getscheduler(0),  # the server preloads at SCHED_IDLE, in a thread
    "session_leader": os.getsid(0) == os.getpid() == os.getpgid(0),
    "stdin": sys.stdin.read(),
    "unbuffered": getattr(sys.stdout, "write_through", False),
    "name": __name__,
    "warm": "workers.runtime.warm_rank" in sys.modules,
    "random": [random.random(), float(numpy.random.rand()), float(torch.rand(1))],
}), flush=True)
sys.exit(int(os.environ.get("EXIT", "0")))
"""

SLEEPER = r"""
import os, signal, sys, time
if os.environ.get("ON_TERM"):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(os.environ["ON_TERM"])))
print("pid", os.getpid(), flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(its socket, its log): a rank server as a warm agent starts it."""
    home = tmp_path_factory.mktemp("warm-ranks")
    socket_path, log = home / "sock" / "socket", home / "server.log"
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", ROOM_VAR: "x" * ROOM_BYTES}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.runtime.warm_rank_server", str(socket_path), " " * COMMAND_ROOM],
            env=env,
            stdin=subprocess.PIPE,
            stderr=out,
        )
    deadline = time.monotonic() + 120
    while not socket_path.is_socket():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    yield socket_path, log
    assert proc.stdin is not None
    proc.stdin.close()  # the agent's end: the server exits by itself
    assert proc.wait(timeout=10) == 0


def _folder(tmp_path: Path, script: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "probe.py").write_text(script)
    return tmp_path


def _env(**extra: str) -> dict[str, str]:
    base = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", "LOCAL_RANK": "0"}
    return {**base, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1", **extra}


def _rank_argv(socket_path: Path | None, *args: str) -> list[str]:
    entry = ["-u", "-m", "workers.runtime.script", "probe.py", *args]
    if socket_path is None:
        return [sys.executable, *entry]
    return [sys.executable, "-I", "-S", CLIENT, str(socket_path), "--", *entry]


def _run(socket_path: Path | None, folder: Path, env: dict[str, str], stdin: str = "") -> tuple[int, str]:
    done = subprocess.run(
        _rank_argv(socket_path, "a", "b c"),
        env=env,
        cwd=folder,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # as torchrun starts a rank
    )
    return done.returncode, done.stdout + done.stderr


def _probe(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def test_a_warm_rank_is_started_exactly_as_a_cold_one(server: tuple[Path, Path], tmp_path: Path) -> None:
    folder = _folder(tmp_path, PROBE)
    env = _env(MY_FLAG="on", EXIT="3")
    warm_code, warm_out = _run(server[0], folder, env, stdin="to the rank")
    cold_code, cold_out = _run(None, folder, env, stdin="to the rank")
    assert (warm_code, cold_code) == (3, 3), warm_out + cold_out
    warm, cold = _probe(warm_out), _probe(cold_out)
    assert warm.pop("warm") and not cold.pop("warm")
    warm.pop("random")
    cold.pop("random")
    for key in warm:
        assert warm[key] == cold[key], key
    assert warm["env"] == env and warm["shown_env"] == env  # /proc shows the rank's environment
    assert warm["cmdline"] == [sys.executable, "-u", "-m", "workers.runtime.script", "probe.py", "a", "b c"]
    assert warm["argv"] == ["a", "b c"] and warm["stdin"] == "to the rank" and warm["name"] == "__main__"
    assert warm["session_leader"] and warm["unbuffered"] and warm["threads"] == 1
    assert warm["python_threads"] == ["MainThread"] and warm["policy"] == os.SCHED_OTHER
    assert "RuntimeWarning" not in warm_out, warm_out


def test_warm_ranks_do_not_share_random_state(server: tuple[Path, Path], tmp_path: Path) -> None:
    folder = _folder(tmp_path, PROBE)
    draws = [_probe(_run(server[0], folder, _env())[1]) for _ in range(2)]
    assert all(d["warm"] for d in draws)
    for a, b in zip(draws[0]["random"], draws[1]["random"], strict=True):
        assert a != b  # random, numpy and torch each seeded afresh, as a cold process is


def _start_sleeper(socket_path: Path, folder: Path, **env: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        _rank_argv(socket_path),
        env=_env(**env),
        cwd=folder,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("pid "), line
    return proc, int(line.split()[1])


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_signals_reach_the_rank_and_its_end_is_the_clients(server: tuple[Path, Path], tmp_path: Path) -> None:
    folder = _folder(tmp_path, SLEEPER)
    proc, pid = _start_sleeper(server[0], folder)
    assert pid != proc.pid
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun's stop: the client's group
    assert proc.wait(timeout=30) == -signal.SIGTERM and _gone(pid)

    proc, pid = _start_sleeper(server[0], folder, ON_TERM="75")
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 75 and _gone(pid)  # the runtime's "preempted", passed on

    proc, pid = _start_sleeper(server[0], folder, ON_TERM="75")
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun's end of grace: the rank dies with its client
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert _gone(pid), "the warm rank outlived its client"


def test_a_rank_starts_cold_wherever_warm_could_differ(server: tuple[Path, Path], tmp_path: Path) -> None:
    folder = _folder(tmp_path / "run", PROBE)
    own = tmp_path / "site"  # the job's environment.pip: a numpy of its own
    own.mkdir()
    (own / "numpy.py").write_text("print('THE JOB S OWN NUMPY', flush=True)\n")
    code, out = _run(server[0], folder, _env(PYTHONPATH=str(own)))
    assert "THE JOB S OWN NUMPY" in out  # imported first, as a cold rank would (then the probe fails)
    assert f"{own}/numpy.py would be shadowed" in server[1].read_text()

    code, out = _run(server[0], folder, _env(PYTHONHASHSEED="7"))
    assert code == 0 and not _probe(out)["warm"], out
    assert "PYTHONHASHSEED differs" in server[1].read_text()

    code, out = _run(tmp_path / "no-server", folder, _env())
    assert code == 0 and not _probe(out)["warm"], out


def test_the_jobs_own_modules_come_first_on_a_warm_path(server: tuple[Path, Path], tmp_path: Path) -> None:
    folder = _folder(tmp_path / "run", PROBE + "\nimport mylib\n")
    own = tmp_path / "site"
    own.mkdir()
    (own / "mylib.py").write_text("VALUE = 1\n")
    code, out = _run(server[0], folder, _env(PYTHONPATH=str(own)))
    probe = _probe(out)
    assert code == 0 and probe["warm"], out
    assert probe["path0"] == [str(folder), str(own)]  # as `python -m` with PYTHONPATH sets it


STOPPING = r"""
import os, signal, sys, time
def stop(*_):
    open(os.environ["MARK"], "w").write("stopped by SIGTERM")
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
print("pid", os.getpid(), flush=True)
time.sleep(120)
"""


def test_a_rank_whose_torchrun_dies_is_stopped_and_saves_as_a_cold_one(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """torchrun SIGKILLed (the worker and its agent killed at once): the rank gets SIGTERM
    from its client (a cold rank's ParentWatchdog does the same), and its server, whose agent
    is gone too, still waits for it rather than leaving it unwatched."""
    with _own_server(tmp_path_factory) as (socket_path, server):
        folder = _folder(tmp_path, STOPPING)
        mark = tmp_path / "mark"
        torchrun = subprocess.Popen(  # stands in for torchrun: the client's parent
            ["sh", "-c", " ".join(map(shlex.quote, _rank_argv(socket_path))) + " & wait"],
            env=_env(MARK=str(mark)),
            cwd=folder,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert torchrun.stdout is not None
        pid = int(torchrun.stdout.readline().split()[1])
        assert server.stdin is not None
        server.stdin.close()  # the agent is gone: no new rank, the running one still watched
        os.kill(torchrun.pid, signal.SIGKILL)
        torchrun.wait()
        assert _gone(pid, timeout=20), "the rank went on after its torchrun died"
        assert mark.read_text() == "stopped by SIGTERM"
        assert server.wait(timeout=20) == 0  # and the server ends once its last rank has


@contextlib.contextmanager
def _own_server(factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    home = factory.mktemp("own-server")
    socket_path = home / "sock" / "socket"
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", ROOM_VAR: "x" * ROOM_BYTES}
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.runtime.warm_rank_server", str(socket_path), " " * COMMAND_ROOM],
        env=env,
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not socket_path.is_socket():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        yield socket_path, proc
    finally:
        proc.kill()
        proc.wait()
