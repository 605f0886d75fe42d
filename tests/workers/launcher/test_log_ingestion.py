"""Logs are kept whole: a burst of output right before exit, a database that refuses a batch,
and lines of stdout and stderr that arrive in pieces (issue 4)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from service.nodes.values import Batch, NodeKey
from workers.launcher.command import LaunchPlan, NodePaths
from workers.launcher.ingest import MAX_READ, RankLogs
from workers.launcher.jobfiles import JobFolder
from workers.launcher.supervisor import Hooks, NodeSupervisor

# A stand-in for torchrun --redirects=3: writes the rank's files the way torchrun lays them out,
# as fast as it can, and exits at once.
FAKE_TORCHRUN = """
import os, sys
rank_dir = os.path.join(sys.argv[1], "run", "attempt_0", "0")
os.makedirs(rank_dir)
err = open(os.path.join(rank_dir, "stderr.log"), "wb")
out = open(os.path.join(rank_dir, "stdout.log"), "wb")
for i in range(int(sys.argv[2])):
    out.write(b"%08d " % i + b"y" * 1000 + b"\\n")
out.write(b"the very last words")
out.flush()
os._exit(0)
"""


def test_a_burst_before_exit_is_stored_whole_even_when_a_write_fails(tmp_path: Path) -> None:
    paths = NodePaths(run_dir=tmp_path / "node")
    lines = 20_000  # about 20 MB: five times what one look reads
    plan = LaunchPlan(
        argv=[sys.executable, "-c", FAKE_TORCHRUN, str(paths.logs), str(lines)],
        env={},
        cwd=tmp_path,
        paths=paths,
        config=None,
    )
    stored: list[tuple[int, int, bytes]] = []
    failures = {"left": 2}

    def write_batch(batch: Batch) -> None:
        if batch.logs and failures["left"]:
            failures["left"] -= 1
            raise OSError("database went away")
        stored.extend(batch.logs)

    supervisor = NodeSupervisor(
        key=NodeKey(job_id=1, attempt=1, node_rank=0),
        plan=plan,
        mode="single",
        gpus=1,
        hooks=Hooks(
            write_batch=write_batch, record_checkpoint=lambda *_: None, job_control=lambda: ("running", 1)
        ),
        grace_s=1,
        shutdown=threading.Event(),
    )
    outcome = supervisor.run()
    assert outcome.state == "succeeded"
    expected = b"".join(b"%08d " % i + b"y" * 1000 + b"\n" for i in range(lines)) + b"the very last words"
    offset = 0
    for local_rank, chunk_offset, data in stored:
        assert local_rank == 0 and chunk_offset == offset
        offset += len(data)
    assert b"".join(data for _, _, data in stored) == expected
    assert failures["left"] == 0 and len(expected) > 4 * MAX_READ


def test_a_line_is_not_cut_in_two_by_the_other_stream(tmp_path: Path) -> None:
    rank_dir = tmp_path / "run" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    out, err = rank_dir / "stdout.log", rank_dir / "stderr.log"
    out.write_bytes(b"one\nhalf of a li")
    err.write_bytes(b"warning\n")
    logs = RankLogs(JobFolder(tmp_path), 0, logs="")
    assert logs.read_new(now=0.0) == (0, b"one\nwarning\n")
    with open(out, "ab") as fh:
        fh.write(b"ne\nprogress 50%\rprogress 60%")
    assert logs.read_new(now=0.5) == (12, b"half of a line\nprogress 50%\r")
    # A partial line is held at most HOLD_S seconds, and never past the final look.
    assert logs.read_new(now=1.0) == (40, b"")
    assert logs.read_new(now=3.0) == (40, b"progress 60%")
    with open(err, "ab") as fh:
        fh.write(b"no newline at exit")
    assert logs.read_new(final=True, now=3.1) == (52, b"no newline at exit")
