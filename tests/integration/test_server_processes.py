"""`torchjobs server --workers N` (issue #42): several API processes on one port, for real.

One PostgreSQL + Redis stack with no worker; the server is started with `--workers 2`. What
must hold with several processes is what holds with one: every request answered, one job per
Idempotency-Key however the requests are spread, and a process that dies replaced while the
others go on answering.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from service.testing import harness
from service.testing.harness import Stack, wait_for

SPEC = {"mode": "single", "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "synthetic"}}


@pytest.fixture
def stack(tmp_path: Path, pg_url: str, redis_url: str) -> Iterator[Stack]:
    two = ("--workers", "2")
    running = harness.production_stack(tmp_path, pg_url, redis_url, workers={}, server_args=two)
    try:
        yield running
    finally:
        running.stop()


def api_processes(stack: Stack) -> list[int]:
    """The server's children that serve (uvicorn spawns them; multiprocessing's resource
    tracker is a child too, and serves nothing)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == stack.procs["server"].pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return sorted(found)


def post(stack: Stack, key: str | None = None) -> tuple[int, int]:
    headers = {"Idempotency-Key": key} if key else {}
    with stack.client() as c:
        answer = c.post("/v1/jobs", json=SPEC, headers=headers)
    return answer.status_code, answer.json()["id"]


def test_two_processes_answer_and_keep_one_job_per_key(stack: Stack) -> None:
    assert len(wait_for(lambda: len(api_processes(stack)) == 2 and api_processes(stack), 60, "two")) == 2
    with ThreadPoolExecutor(8) as pool:
        plain = list(pool.map(lambda _: post(stack), range(24)))
        keyed = list(pool.map(lambda _: post(stack, "one-key"), range(16)))
    assert [code for code, _ in plain] == [201] * 24 and len({i for _, i in plain}) == 24
    assert sorted(code for code, _ in keyed).count(201) == 1, keyed
    assert len({i for _, i in keyed}) == 1
    with stack.client() as c:
        listed = c.get("/v1/jobs", params={"limit": 100}).json()["items"]
    assert len(listed) == 25


def test_a_killed_process_is_replaced_while_the_other_answers(stack: Stack) -> None:
    first = wait_for(lambda: len(api_processes(stack)) == 2 and api_processes(stack), 60, "two processes")
    os.kill(first[0], signal.SIGKILL)
    codes = [post(stack)[0] for _ in range(10)]  # the other process answers meanwhile
    assert codes == [201] * 10
    again = wait_for(
        lambda: (now := api_processes(stack)) and len(now) == 2 and first[0] not in now and now,
        60,
        "a new process in place of the killed one",
    )
    assert first[1] in again
    wait_for(lambda: post(stack)[0] == 201, 30, "answers")
