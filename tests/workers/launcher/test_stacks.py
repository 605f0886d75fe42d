"""A silent rank's stack, from outside (py-spy) and from inside (faulthandler on SIGUSR1),
taken from real processes: a "rank" with a DataLoader-like child and an agent-like parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.testing.harness import wait_for
from workers.launcher.procs import pids_under
from workers.launcher.stacks import dump_stack, py_spy, rank_processes, take_stacks

Rank = tuple[subprocess.Popen[bytes], Path]
RANK = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from workers.runtime.stacks import allow_stack_dumps

    def loader_child():
        time.sleep(600)

    def waiting_in_a_named_place():
        print("ready", flush=True)
        while True:
            time.sleep(0.2)

    if __name__ == "__main__":
        allow_stack_dumps()
        multiprocessing.get_context("fork").Process(target=loader_child, daemon=True).start()
        waiting_in_a_named_place()
    """
)


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[Rank]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    stderr = tmp_path / "stderr.log"
    env = {**os.environ, "LOCAL_RANK": "1", "TORCHJOBS_CHECKPOINT_DIR": f"{tmp_path}/ckpt"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=err, start_new_session=True
        )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    wait_for(lambda: len(pids_under(f"{tmp_path}/")) == 2, 10, "the rank and its child")
    yield proc, stderr
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_the_rank_is_found_not_its_loader_child(rank: Rank, tmp_path: Path) -> None:
    proc, _ = rank
    assert rank_processes(pids_under(f"{tmp_path}/")) == {1: proc.pid}


def test_py_spy_names_the_function_the_rank_waits_in(rank: Rank) -> None:
    proc, _ = rank
    assert py_spy() is not None, "py-spy is a dependency of the worker"
    text = dump_stack(proc.pid)
    assert text is not None and "waiting_in_a_named_place" in text, text


def test_a_rank_py_spy_cannot_read_writes_its_own_stack_to_its_log(
    rank: Rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc, stderr = rank
    monkeypatch.setattr("workers.launcher.stacks.py_spy", lambda: None)
    [stack] = take_stacks({1: proc.pid})
    assert stack.text is None
    wait_for(lambda: "waiting_in_a_named_place" in stderr.read_text(), 10, "the rank's own dump")
    time.sleep(0.5)
    assert proc.poll() is None, "the dump does not end the rank"


def test_a_gone_process_has_no_stack() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    assert dump_stack(int(done.stdout)) is None
