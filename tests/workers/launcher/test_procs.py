"""Finding a node's processes by their environment, even in sessions of their own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from workers.launcher.procs import kill_under, pids_under


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
