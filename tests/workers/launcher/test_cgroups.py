"""A job node's control groups (contract §7 v3): real cgroups of this host, real processes.

The limits hold (forks refused past the process limit, a process killed past the memory limit,
shared memory counted), the node's error names the limit it passed, and everything in a node's
groups is killed: at its end, and by a worker that starts after its predecessor was killed."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.launcher import cgroups
from workers.launcher.cgroups import Hierarchy, NodeGroup


@pytest.fixture
def hierarchy(tmp_path: Path) -> Iterator[Hierarchy]:
    found = cgroups.detect(f"test-{uuid.uuid4().hex[:8]}", tmp_path)
    if found is None:
        pytest.skip("no writable cgroups on this host (needs root and cgroup v1 or v2)")
    yield found
    cgroups.sweep(found)
    for folder in found.folders:
        folder.rmdir()


def _run(group: NodeGroup, code: str) -> subprocess.CompletedProcess[str]:
    """The first process's exit and output (to a file: children left behind keep pipes open)."""
    argv = group.join_argv([sys.executable, "-c", code])
    with tempfile.TemporaryFile("w+") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=120).returncode
        out.seek(0)
        return subprocess.CompletedProcess(argv, rc, out.read(), "")


def test_forks_past_the_process_limit_are_refused_and_named(hierarchy: Hierarchy) -> None:
    group = NodeGroup.make(hierarchy, "pids", pids_max=20, memory_bytes=None)
    code = (
        "import os, time\n"
        "for i in range(400):\n"
        "    try:\n"
        "        if os.fork() == 0: time.sleep(60); os._exit(0)\n"
        "    except OSError: print('refused at', i); break\n"
    )
    done = _run(group, code)
    assert "refused at" in done.stdout
    assert int(done.stdout.split()[-1]) < 20
    assert (group.passed() or "").startswith("process limit")
    assert group.kill_all() > 0 and group.pids() == []
    group.remove()
    assert not any(folder.exists() for folder in group.folders)


@pytest.mark.parametrize("where", ["heap", "shared memory"])
def test_memory_past_the_limit_kills_and_is_named(hierarchy: Hierarchy, where: str) -> None:
    group = NodeGroup.make(hierarchy, "memory", pids_max=64, memory_bytes=128 * 1024 * 1024)
    if where == "heap":
        code = "b = []\nwhile True: b.append(bytearray(16 * 1024 * 1024))"
    else:  # tmpfs pages are charged to the group that wrote them
        code = (
            "import os\n"
            "with open(f'/dev/shm/tj-{os.getpid()}', 'wb') as fh:\n"
            "    try:\n"
            "        for _ in range(64): fh.write(b'x' * 16 * 1024 * 1024); fh.flush()\n"
            "    finally: os.unlink(fh.name)\n"
        )
    done = _run(group, code)
    assert done.returncode != 0
    assert (group.passed() or "").startswith("memory limit")
    group.kill_all()
    group.remove()


def test_a_node_within_its_limits_passes_none(hierarchy: Hierarchy) -> None:
    group = NodeGroup.make(hierarchy, "fine", pids_max=64, memory_bytes=256 * 1024 * 1024)
    assert _run(group, "print(sum(range(1000)))").stdout.strip() == "499500"
    assert group.passed() is None
    group.remove()


def test_a_starting_worker_kills_what_its_killed_predecessor_left(hierarchy: Hierarchy) -> None:
    """The worker died (SIGKILL, OOM): its node's processes, reparented to init, live on in the
    group. The next start's sweep ends them, wherever in the tree they went."""
    group = NodeGroup.make(hierarchy, "job-7-1-0", pids_max=64, memory_bytes=None)
    code = "import os, subprocess, sys, time\nif os.fork(): os._exit(0)\nos.setsid(); time.sleep(300)"
    _run(group, code)  # the parent exits at once: an orphan in its own session is left
    orphans = group.pids()
    assert orphans, "nothing was left to find"
    assert cgroups.sweep(hierarchy) >= len(orphans)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in orphans):
        assert time.monotonic() < deadline, "an orphan outlived the sweep"
        time.sleep(0.05)
    assert list(cgroups.leftovers(hierarchy)) == []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
