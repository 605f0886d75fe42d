"""Each rank's stored log is capped per attempt, with a line saying where it was cut
(contract §7 v3, `TORCHJOBS_LOG_MAX_MB`): a job cannot push unbounded output into the database."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from service.config import Settings
from service.nodes.values import Batch, JobControl, NodeKey
from workers.launcher.command import LaunchPlan, NodePaths
from workers.launcher.ingest import LOG_MAX_BYTES, RankLogs
from workers.launcher.jobfiles import JobFolder
from workers.launcher.supervisor import Hooks, NodeSupervisor

CUT = b"[torchjobs] log cut at "
TAIL = b" MB (TORCHJOBS_LOG_MAX_MB): the rest of this rank's output in this attempt is not stored\n"


def rank_files(tmp_path: Path) -> tuple[Path, Path]:
    rank_dir = tmp_path / "r_x" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    out, err = rank_dir / "stdout.log", rank_dir / "stderr.log"
    out.write_bytes(b"")
    err.write_bytes(b"")
    return out, err


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def test_output_past_the_cap_is_cut_at_the_cap_with_one_line(tmp_path: Path) -> None:
    out, err = rank_files(tmp_path)
    out.write_bytes(b"a" * 60 + b"\n")
    logs = RankLogs(JobFolder(tmp_path), 0, logs="", max_bytes=100)
    assert logs.read_new(now=0.0) == (0, b"a" * 60 + b"\n")
    append(out, b"b" * 30 + b"\n" + b"c" * 30 + b"\n")
    append(err, b"e" * 50 + b"\n")
    start, data = logs.read_new(now=1.0)
    assert start == 61
    kept, line = data[:39], data[39:]
    assert kept == b"b" * 30 + b"\n" + b"c" * 8  # the stored bytes end exactly at the cap
    assert line.startswith(b"\n" + CUT) and line.endswith(TAIL)  # on a line of its own
    assert line.count(CUT) == 1
    assert logs.offset == start + len(data) and logs.backlog is False
    append(out, b"more\n")
    append(err, b"more\n")
    assert logs.read_new(now=2.0) == (logs.offset, b"")
    assert logs.read_new(final=True, now=3.0) == (logs.offset, b"")


def test_a_cut_after_a_whole_line_adds_no_empty_line(tmp_path: Path) -> None:
    out, _ = rank_files(tmp_path)
    out.write_bytes(b"x" * 9 + b"\n" + b"y" * 20 + b"\n")
    logs = RankLogs(JobFolder(tmp_path), 0, logs="", max_bytes=10)
    start, data = logs.read_new(now=0.0)
    assert start == 0 and data.startswith(b"x" * 9 + b"\n" + CUT) and data.endswith(TAIL)


def test_the_files_are_not_read_after_the_cut(tmp_path: Path) -> None:
    out, _ = rank_files(tmp_path)
    out.write_bytes(b"z" * 200 + b"\n")
    logs = RankLogs(JobFolder(tmp_path), 0, logs="", max_bytes=50)
    logs.read_new(now=0.0)
    read_to = [tail.offset for tail in logs.streams]
    append(out, b"z" * 10_000 + b"\n")
    logs.read_new(now=1.0)
    logs.read_new(final=True, now=2.0)
    assert [tail.offset for tail in logs.streams] == read_to


def test_a_stall_note_after_the_cut_still_appears(tmp_path: Path) -> None:
    out, _ = rank_files(tmp_path)
    out.write_bytes(b"w" * 500 + b"\n")
    logs = RankLogs(JobFolder(tmp_path), 0, logs="", max_bytes=100)
    _, first = logs.read_new(now=0.0)
    assert first.endswith(TAIL)
    logs.note("[stall] no output for 60 s\nFile train.py, line 3")
    start, data = logs.read_new(now=1.0)
    assert start == len(first)
    assert data == b"[stall] no output for 60 s\nFile train.py, line 3\n"
    assert logs.offset == len(first) + len(data)
    assert logs.read_new(now=2.0) == (logs.offset, b"")


def test_output_under_the_cap_is_whole_and_the_default_is_100_mib(tmp_path: Path) -> None:
    out, err = rank_files(tmp_path)
    out.write_bytes(b"out\n")
    err.write_bytes(b"err\n")
    logs = RankLogs(JobFolder(tmp_path), 0, logs="")
    assert logs.read_new(now=0.0) == (0, b"out\nerr\n")
    assert LOG_MAX_BYTES == 100 * 1024 * 1024 and logs.room == LOG_MAX_BYTES - 8
    assert logs.cut_line.startswith(b"[torchjobs] log cut at 100 MB ")


# A stand-in for torchrun --redirects=3 whose one rank prints far past the cap.
LOUD_TORCHRUN = """
import os, sys
rank_dir = os.path.join(sys.argv[1], "run", "attempt_0", "0")
os.makedirs(rank_dir)
open(os.path.join(rank_dir, "stderr.log"), "wb").close()
with open(os.path.join(rank_dir, "stdout.log"), "wb") as out:
    for i in range(5000):
        out.write(b"%06d " % i + b"y" * 100 + b"\\n")
"""


def test_a_supervised_rank_past_the_cap_is_stored_up_to_it(tmp_path: Path) -> None:
    cap = int(0.01 * 1024 * 1024)  # TORCHJOBS_LOG_MAX_MB=0.01
    paths = NodePaths(run_dir=tmp_path / "node")
    plan = LaunchPlan(
        argv=[sys.executable, "-c", LOUD_TORCHRUN, str(paths.logs)],
        env={},
        cwd=tmp_path,
        paths=paths,
        config=None,
    )
    stored: list[tuple[int, int, bytes]] = []

    def write_batch(batch: Batch) -> None:
        stored.extend(batch.logs)

    supervisor = NodeSupervisor(
        key=NodeKey(job_id=1, attempt=1, node_rank=0),
        plan=plan,
        mode="single",
        gpus=1,
        hooks=Hooks(
            write_batch=write_batch,
            record_checkpoint=lambda *_: None,
            job_control=lambda: JobControl("running", 1),
        ),
        grace_s=1,
        shutdown=threading.Event(),
        log_max_bytes=cap,
    )
    assert supervisor.run().state == "succeeded"
    offset = 0
    for local_rank, chunk_offset, data in stored:
        assert local_rank == 0 and chunk_offset == offset
        offset += len(data)
    log = b"".join(data for _, _, data in stored)
    expected = b"".join(b"%06d " % i + b"y" * 100 + b"\n" for i in range(5000))
    assert log[:cap] == expected[:cap]
    assert log[cap:].startswith(b"\n" + CUT + b"0.01" + TAIL) and log.endswith(TAIL)
    assert log.count(CUT) == 1


def test_settings_take_the_cap_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.model_fields["log_max_mb"].default == 100
    monkeypatch.setenv("TORCHJOBS_LOG_MAX_MB", "0.5")
    assert Settings().log_max_mb == 0.5
    monkeypatch.setenv("TORCHJOBS_LOG_MAX_MB", "0")
    with pytest.raises(ValueError, match="log_max_mb"):
        Settings()


def test_output_past_the_cap_still_tells_the_stall_clock_the_rank_speaks(tmp_path: Path) -> None:
    """Contract §8 counts any log byte as a report: a rank printing past its cap is not silent."""
    out, _ = rank_files(tmp_path)
    out.write_bytes(b"z" * 50 + b"\n")
    logs = RankLogs(JobFolder(tmp_path), 0, logs="", max_bytes=10)
    logs.read_new(now=0.0)
    assert logs.cut
    logs.read_new(now=1.0)
    assert not logs.talking  # nothing new since the cut
    append(out, b"still printing\n")
    logs.read_new(now=2.0)
    assert logs.talking
    logs.read_new(now=3.0)
    assert not logs.talking
