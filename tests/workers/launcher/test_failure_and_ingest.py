"""Root-cause parsing, the retry classifier, and the on-disk readers of a node."""

from __future__ import annotations

import json
import os
from pathlib import Path

from workers.launcher.failure import is_retryable, read_error_file, root_cause
from workers.launcher.ingest import CheckpointWatcher, EventsTail, RankLogs
from workers.launcher.jobfiles import JobFolder

AGENT_LOG = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_09:00:01
  host      : vm
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_09:00:00
  host      : vm
  rank      : 3 (local_rank: 1)
  exitcode  : 7 (pid: 12)
  error_file: <N/A>
============================================================
"""


def test_root_cause_is_the_first_failure_not_the_knock_on() -> None:
    cause = root_cause(AGENT_LOG)
    assert (cause.rank, cause.local_rank, cause.exit_code) == (3, 1, 7)
    assert root_cause("nothing here").rank is None


def test_error_file_traceback(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(
        json.dumps({"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": "Traceback..."}}})
    )
    assert read_error_file(path.read_bytes()) == "Traceback..."
    assert read_error_file(b"") is None
    assert read_error_file(b'{"message": {"extraInfo": 7}}') is None  # the job wrote it: any shape


def test_classifier() -> None:
    assert is_retryable(-9, "", signalled_by_us=False)  # killed by a signal nobody asked for
    assert not is_retryable(-15, "", signalled_by_us=True)
    assert is_retryable(75, "", signalled_by_us=False)  # preempted rank
    assert is_retryable(1, "torch.distributed.DistNetworkError: Connection reset by peer", False)
    assert not is_retryable(1, "ValueError: bad input", False)
    preflight = "PreflightError: rank 1 of 4 (node 1, host b): pre-flight could not connect to every rank"
    assert is_retryable(1, preflight, False)  # the network, not the job
    assert not is_retryable(-9, "torch.OutOfMemoryError: CUDA out of memory", False)


def test_events_tail_waits_for_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = EventsTail(JobFolder(tmp_path), path.name)
    assert tail.read_new() == []
    path.write_bytes(b'{"a": 1}\n{"b"')
    assert tail.read_new() == [{"a": 1}]
    with open(path, "ab") as fh:
        fh.write(b": 2}\nnot json\n")
    assert tail.read_new() == [{"b": 2}]


def test_rank_logs_combine_stdout_and_stderr(tmp_path: Path) -> None:
    rank_dir = tmp_path / "torchjobs-1-1_abc" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stdout.log").write_bytes(b"out1\n")
    (rank_dir / "stderr.log").write_bytes(b"err1\n")
    logs = RankLogs(JobFolder(tmp_path), 0, logs="")
    assert logs.read_new() == (0, b"out1\nerr1\n")
    with open(rank_dir / "stdout.log", "ab") as fh:
        fh.write(b"out2\n")
    assert logs.read_new() == (10, b"out2\n")
    assert logs.read_new() == (15, b"")


def test_checkpoint_watcher_takes_complete_files_once(tmp_path: Path) -> None:
    watcher = CheckpointWatcher(JobFolder(tmp_path), "")
    (tmp_path / "a.pt.tmp").write_bytes(b"x")
    (tmp_path / ".hidden").write_bytes(b"x")
    (tmp_path / "b.partial").write_bytes(b"x")
    (tmp_path / "epoch-0001.pt").write_bytes(b"1")
    assert watcher.poll() == []  # seen once: might still be growing
    found = watcher.poll()
    assert [f.name for f in found] == ["epoch-0001.pt"]
    assert watcher.poll() == []  # never twice
    growing = tmp_path / "epoch-0002.pt"
    growing.write_bytes(b"1")
    watcher.poll()
    with open(growing, "ab") as fh:
        fh.write(b"more")
    os.utime(growing, ns=(1, 10**18))
    assert watcher.poll() == []  # it changed since the last look
    assert [f.name for f in watcher.poll(final=True)] == ["epoch-0002.pt"]


def test_a_name_written_again_is_a_new_checkpoint(tmp_path: Path) -> None:
    """A script saving `last.pt` every epoch: each save that the watcher sees is taken."""
    watcher = CheckpointWatcher(JobFolder(tmp_path), "")
    last = tmp_path / "last.pt"
    last.write_bytes(b"epoch 1")
    watcher.poll()
    assert [(f.name, f.version) for f in watcher.poll()] == [("last.pt", 0)]
    assert watcher.poll() == []
    (tmp_path / "last.pt.tmp").write_bytes(b"epoch 2")
    os.replace(tmp_path / "last.pt.tmp", last)  # renamed over the taken file
    assert watcher.poll() == []  # seen once
    assert [(f.name, f.version) for f in watcher.poll()] == [("last.pt", 1)]
    last.write_bytes(b"epoch 3")  # rewritten in place, same size
    os.utime(last, ns=(1, 10**18))
    assert [(f.name, f.version) for f in watcher.poll(final=True)] == [("last.pt", 2)]
    assert watcher.poll(final=True) == []  # unchanged since: never twice


def test_a_stall_note_starts_its_own_line_even_after_a_partial_one(tmp_path: Path) -> None:
    """Contract §8: the `[stall]` line starts a line, also when the rank's last output was a
    partial line that the hold let out (a progress bar without its newline, then the hang)."""
    from workers.launcher.ingest import HOLD_S, RankLogs

    folder = tmp_path / "run" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    (folder / "stdout.log").write_bytes(b"epoch 1 ... 40%")
    (folder / "stderr.log").write_bytes(b"")
    logs = RankLogs(JobFolder(tmp_path), 0, logs="")
    assert logs.read_new(now=0.0)[1] == b""  # held: no newline yet
    assert logs.read_new(now=HOLD_S + 1)[1] == b"epoch 1 ... 40%"  # let out by the hold
    logs.note("[stall] silent")
    _, data = logs.read_new(now=HOLD_S + 2)
    assert data == b"\n[stall] silent\n"
    logs.note("[stall] again")
    assert logs.read_new(now=HOLD_S + 3)[1] == b"[stall] again\n"
