"""Finding a node's processes by their environment, even in sessions of their own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from service.nodes.values import NodeKey
from workers.launcher.command import LaunchPlan, NodePaths
from workers.launcher.procs import (
    kill_under,
    parent_of,
    pid_namespace,
    pids_in_namespace,
    pids_under,
    pin_sandbox_namespace,
    sandbox_namespace,
    signal_all,
)
from workers.launcher.sandbox import SANDBOX, Isolation
from workers.launcher.supervisor import Hooks, NodeSupervisor


def test_finds_and_kills_processes_in_their_own_sessions(tmp_path: Path) -> None:
    node = tmp_path / "node-1"
    other = tmp_path / "node-10"
    procs = []
    for run in (node, other):
        env = {**os.environ, "TORCHJOBS_CHECKPOINT_DIR": f"{run}/checkpoints"}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
            )
        )
    try:
        time.sleep(0.5)
        assert pids_under(f"{node}/") == [procs[0].pid]  # node-1 is not a prefix of node-10/
        assert kill_under(f"{node}/") == 1
        assert procs[0].wait(timeout=10) == -9
        assert procs[1].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _sandbox() -> subprocess.Popen[bytes]:
    """A stand-in for bwrap's outer process: its child is PID 1 of a PID namespace of its own."""
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "sleep", "60"], start_new_session=True
    )


def _namespace_of(outer: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 10
    while (ns := sandbox_namespace(outer.pid)) is None:
        assert time.monotonic() < deadline, "the sandbox's namespace never appeared"
        time.sleep(0.02)
    return ns


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare")
def test_a_stop_never_kills_a_sandbox_made_under_its_emptied_namespace_s_name(tmp_path: Path) -> None:
    """The kernel gives a freed namespace's number to the next one made. A node whose sandbox
    has emptied (its ranks ended, or died on the stop's SIGTERM) and that then SIGKILLs every
    process "of its namespace" must not kill another node's sandbox made meanwhile under that
    name: with two stacks on one host, another job failed with exit 137 so."""
    paths = NodePaths(run_dir=tmp_path / "node")
    plan = LaunchPlan(
        argv=[], env={}, cwd=tmp_path, paths=paths, config=None, isolation=Isolation(kind=SANDBOX)
    )
    hooks = Hooks(write_batch=lambda _b: None, record_checkpoint=lambda *_: None, job_control=lambda: None)
    node = NodeSupervisor(
        key=NodeKey(job_id=1, attempt=1, node_rank=0), plan=plan, mode="single", gpus=1, hooks=hooks,
        grace_s=1, shutdown=threading.Event(),
    )  # fmt: skip
    mine = _sandbox()
    others: list[subprocess.Popen[bytes]] = []
    try:
        _namespace_of(mine)
        node._find_namespace(mine)
        assert node.namespace is not None and node._pids()
        signal_all(node._pids(), signal.SIGKILL)  # the node's sandbox empties
        assert mine.wait(timeout=10) != 0
        for _ in range(3):  # other sandboxes made now: unpinned, the first took the freed name
            others.append(_sandbox())
            assert _namespace_of(others[-1]) != node.namespace
        assert node._pids() == []
        node._kill_all(mine)  # what the end of the node does
        time.sleep(0.2)
        assert all(other.poll() is None for other in others)
    finally:
        node._release_namespace()
        for proc in [mine, *others]:
            proc.kill()
            proc.wait()
    assert node.namespace is None and node.namespace_fd is None


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare")
def test_a_pinned_namespace_is_the_sandbox_s_own() -> None:
    outer = _sandbox()
    try:
        ns = _namespace_of(outer)
        pinned = pin_sandbox_namespace(outer.pid)
        assert pinned is not None
        try:
            assert pinned[0] == ns != pid_namespace("self")
            (inside,) = pids_in_namespace(ns)  # `sleep`, PID 1 there
            assert parent_of(inside) == outer.pid
        finally:
            os.close(pinned[1])
    finally:
        outer.kill()
        outer.wait()
    assert pin_sandbox_namespace(outer.pid) is None
