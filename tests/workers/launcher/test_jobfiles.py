"""The worker never follows the job (contract §7 v3): what a job puts in its own folder where
the worker expects a log, a checkpoint or a folder is taken only as the job's own regular file.

Each test plants what a hostile rank would (a link to a host secret, a fifo, a swapped file, a
link where a folder should be) and checks the worker's readers take nothing through it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from workers.launcher import jobfiles
from workers.launcher.command import NodePaths
from workers.launcher.ingest import CheckpointWatcher, EventsTail, RankLogs
from workers.launcher.jobfiles import JobFolder, Refused, open_beneath
from workers.launcher.run_dir import remove_run_dir

SECRET = b"admin-token-0123456789"


@pytest.fixture(autouse=True, params=["openat2", "per-component"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test both ways: the kernel's openat2, and O_NOFOLLOW one component at a time."""
    if request.param == "per-component":
        monkeypatch.setattr(jobfiles, "_has_openat2", False)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "host" / "admin.token"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def run(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    (folder / "logs" / "r_x" / "attempt_0" / "0").mkdir(parents=True)
    (folder / "checkpoints").mkdir()
    return folder


def _rank_dir(run: Path) -> Path:
    return run / "logs" / "r_x" / "attempt_0" / "0"


def test_a_link_is_refused_wherever_it_is_on_the_way(run: Path, secret: Path) -> None:
    (run / "direct").symlink_to(secret)
    (run / "inside").symlink_to(run / "logs")  # even a link that stays inside
    (run / "up").symlink_to(secret.parent)
    folder = JobFolder(run)
    for rel in ("direct", "inside/r_x", "up/admin.token", "../host/admin.token", "/etc/passwd"):
        with pytest.raises(Refused):
            folder.open(rel)
    assert folder.read_tail("direct", 100) == b""


def test_a_fifo_or_a_folder_is_refused_without_blocking(run: Path) -> None:
    os.mkfifo(run / "fifo")
    folder = JobFolder(run)
    done = threading.Event()

    def look() -> None:
        with pytest.raises(Refused):
            folder.open("fifo")
        with pytest.raises(Refused):
            folder.open("logs")
        done.set()

    thread = threading.Thread(target=look, daemon=True)
    thread.start()
    thread.join(5)
    assert done.is_set(), "opening a fifo held the worker"


def test_a_file_swapped_after_it_was_opened_is_read_from_what_was_opened(run: Path, secret: Path) -> None:
    log = _rank_dir(run) / "stdout.log"
    log.write_bytes(b"line 1\n")
    (_rank_dir(run) / "stderr.log").write_bytes(b"")
    logs = RankLogs(JobFolder(run), 0)
    assert logs.read_new(final=True)[1] == b"line 1\n"
    log.unlink()
    log.symlink_to(secret)  # the rank swaps its log for a link to a host secret
    assert SECRET not in logs.read_new(final=True)[1]


def test_log_links_to_host_files_are_never_read_and_the_log_says_why(run: Path, secret: Path) -> None:
    (_rank_dir(run) / "stdout.log").symlink_to(secret)
    (_rank_dir(run) / "stderr.log").symlink_to("/proc/self/environ")
    logs = RankLogs(JobFolder(run), 0)
    data = logs.read_new(final=True)[1]
    assert SECRET not in data and b"PATH=" not in data
    assert len(logs.refusals()) == 2
    assert b"[torchjobs] not read, not a regular file" in logs.read_new(final=True)[1]
    assert logs.stderr_tail(1000) == b""
    (_rank_dir(run) / "error.json").symlink_to(secret)
    assert logs.error_file() == b""


def test_a_link_where_the_logs_folder_was_is_not_walked(run: Path, secret: Path) -> None:
    elsewhere = secret.parent / "r_y" / "attempt_0" / "0"
    elsewhere.mkdir(parents=True)
    (elsewhere / "stdout.log").write_bytes(SECRET)
    (elsewhere / "stderr.log").write_bytes(SECRET)
    os.rename(run / "logs", run / "old-logs")
    (run / "logs").symlink_to(secret.parent)
    assert SECRET not in RankLogs(JobFolder(run), 0).read_new(final=True)[1]


def test_an_events_file_that_is_a_link_or_a_fifo_gives_nothing(run: Path, secret: Path) -> None:
    (run / "events.jsonl").symlink_to(secret)
    assert EventsTail(JobFolder(run), "events.jsonl").read_new() == []
    (run / "events.jsonl").unlink()
    os.mkfifo(run / "events.jsonl")
    tail = EventsTail(JobFolder(run), "events.jsonl")
    assert not tail.waiting() and tail.read_new() == []


def test_a_checkpoint_swapped_for_a_link_between_the_look_and_the_upload_is_not_taken(
    run: Path, secret: Path
) -> None:
    ckpts = run / "checkpoints"
    (ckpts / "epoch-1.pt").write_bytes(b"weights")
    watcher = CheckpointWatcher(JobFolder(run))
    assert watcher.poll() == []  # seen once
    (ckpts / "epoch-1.pt").unlink()
    (ckpts / "epoch-1.pt").symlink_to(secret)  # the moment the rank's inotify says "complete"
    assert watcher.poll() == [] and watcher.poll(final=True) == []


def test_a_checkpoint_swapped_for_another_file_is_taken_only_once_that_file_is_complete(run: Path) -> None:
    ckpts = run / "checkpoints"
    (ckpts / "epoch-1.pt").write_bytes(b"weights")
    watcher = CheckpointWatcher(JobFolder(run))
    watcher.poll()
    (ckpts / "other").write_bytes(b"something else entirely")
    os.replace(ckpts / "other", ckpts / "epoch-1.pt")
    assert watcher.poll() == []  # not the file that was seen complete: looked at again
    found = watcher.poll()
    assert [f.name for f in found] == ["epoch-1.pt"]
    assert found[0].file.read() == b"something else entirely"  # read from the descriptor checked


def test_a_link_where_the_checkpoint_folder_was_gives_no_checkpoint(run: Path, secret: Path) -> None:
    os.rename(run / "checkpoints", run / "old")
    (run / "checkpoints").symlink_to(secret.parent)
    watcher = CheckpointWatcher(JobFolder(run))
    assert watcher.poll() == [] and watcher.poll(final=True) == []


def test_a_hard_link_to_a_file_that_is_not_the_jobs_is_refused(run: Path, secret: Path) -> None:
    """A sandbox cannot make one (other mounts), nor can a user under protected_hardlinks; the
    worker refuses it anyway where the kernel would have let it be made."""
    os.link(secret, run / "checkpoints" / "epoch-1.pt")
    owner = os.getuid() + 1  # the ranks' uid: not the owner of the host's file
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(Refused):
            open_beneath(fd, "checkpoints/epoch-1.pt", owner=owner)
    finally:
        os.close(fd)


def test_cleanup_never_follows_a_link_the_job_left(run: Path, tmp_path: Path) -> None:
    """Clean-up removes the TMPDIR whose path the worker chose, not a link's target: a job that
    re-points `/job/tmp` at a host folder deletes nothing outside its own folders."""
    canary = tmp_path / "canary"
    canary.mkdir(mode=0o700)
    (canary / "keep").write_text("still here")
    paths = NodePaths(run_dir=run, tmp_root=tmp_path / "tmproot")
    paths.tmp.mkdir(parents=True)
    (paths.tmp / "scratch").write_text("x")
    (run / "tmp").symlink_to(canary)
    (paths.tmp / "link-out").symlink_to(canary)
    remove_run_dir(paths)
    assert (canary / "keep").read_text() == "still here"
    assert not run.exists() and not paths.tmp.exists()


def test_an_events_line_longer_than_any_event_is_dropped_not_held(run: Path) -> None:
    """A sparse terabyte with no newline would be held, and copied at each look, for ever."""
    from workers.launcher.ingest import MAX_EVENT_LINE

    events = run / "events.jsonl"
    events.write_bytes(b'{"a": 1}\n' + b"x" * (MAX_EVENT_LINE + 10))
    tail = EventsTail(JobFolder(run), "events.jsonl")
    got = []
    while batch := tail.read_new() or tail.tail.size() > tail.tail.offset:
        got += batch if isinstance(batch, list) else []
    assert got == [{"a": 1}] and tail.buffer == b""
    with open(events, "ab") as fh:
        fh.write(b'still the long line"}\n{"b": 2}\n')
    assert tail.read_new() == [{"b": 2}]


def test_cleanup_removes_a_tree_of_any_depth(run: Path, tmp_path: Path) -> None:
    """Python 3.11's rmtree recurses: 3000 folders deep made it raise and keep everything."""
    (run / "home").mkdir()
    fd = os.open(run / "home", os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(3000):  # as a rank would: one level at a time (os.makedirs recurses too)
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    paths = NodePaths(run_dir=run, tmp_root=tmp_path / "tmproot")
    remove_run_dir(paths)
    assert not run.exists()


def test_a_checkpoint_is_read_no_further_than_it_was_complete(run: Path) -> None:
    ckpts = run / "checkpoints"
    (ckpts / "epoch-1.pt").write_bytes(b"w" * 100)
    watcher = CheckpointWatcher(JobFolder(run))
    watcher.poll()
    (found,) = watcher.poll()
    with open(ckpts / "epoch-1.pt", "ab") as fh:  # grown while stored: the rest is not read
        fh.write(b"more" * 1000)
    assert b"".join(iter(lambda: found.file.read(64), b"")) == b"w" * 100


def test_a_checkpoint_that_shrinks_while_stored_is_not_taken(run: Path) -> None:
    from workers.launcher.ingest import CheckpointChanged

    ckpts = run / "checkpoints"
    (ckpts / "epoch-1.pt").write_bytes(b"w" * 100)
    watcher = CheckpointWatcher(JobFolder(run))
    watcher.poll()
    (found,) = watcher.poll()
    os.truncate(ckpts / "epoch-1.pt", 10)
    with pytest.raises(CheckpointChanged):
        b"".join(iter(lambda: found.file.read(64), b""))


def test_sparse_oversized_and_unnamable_files_are_no_checkpoints(run: Path) -> None:
    ckpts = run / "checkpoints"
    with open(ckpts / "sparse.pt", "wb") as fh:
        fh.truncate(1 << 40)  # a terabyte of holes: nothing on disk, forever to upload
    (ckpts / "big.pt").write_bytes(b"x" * 5000)
    (ckpts / os.fsdecode(b"bad\xff.pt")).write_bytes(b"x")
    (ckpts / "ok.pt").write_bytes(b"x")
    watcher = CheckpointWatcher(JobFolder(run), max_bytes=4096)
    watcher.poll()
    assert [f.name for f in watcher.poll()] == ["ok.pt"]
    refused = " ".join(watcher.take_refusals())
    assert "sparse.pt" in refused and "big.pt" in refused
    assert watcher.poll(final=True) == [] and watcher.take_refusals() == []  # said once


def test_what_a_rank_says_of_a_checkpoint_is_kept_only_as_far_as_it_fits() -> None:
    from workers.launcher.ingest import checkpoint_meta

    meta = checkpoint_meta(
        {"epoch": 10**20, "step": -1, "metrics": {"loss": 0.5, "bad\x00": 1, "nan": float("nan"), "s": "x"}},
        "epoch-3.pt",
    )
    assert meta == {"epoch": None, "metrics": {"loss": 0.5}}
    assert checkpoint_meta(None, "epoch-3.pt") == {"epoch": 3}
    assert checkpoint_meta({"epoch": 2, "step": 40}, "last.pt") == {"epoch": 2, "step": 40}
