"""Folder checkpoints on the worker's side (contract §11), on real files: when a folder is
complete, what a look takes of it, and what a hostile job cannot make the worker read (links,
fifos, files swapped or grown between the look and the read)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from workers.launcher.folders import (
    DONE_DIR,
    FolderRefused,
    FolderRules,
    FolderWatcher,
    chunks,
    walk,
)
from workers.launcher.ingest import CheckpointChanged
from workers.launcher.jobfiles import JobFolder
from workers.runtime import checkpoint_done


@pytest.fixture
def run(tmp_path: Path) -> tuple[JobFolder, Path]:
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    return JobFolder(tmp_path), ckpts


def watcher(folder: JobFolder, settle_s: float = 1000.0, lead: bool = True) -> FolderWatcher:
    return FolderWatcher(folder, "checkpoints", FolderRules(settle_s=settle_s, lead=lead))


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def read_all(w: FolderWatcher, name: str, files: tuple) -> dict[str, bytes]:
    out = {}
    for sig in files:
        src = w.open_file(name, sig)
        try:
            out[sig[0]] = b"".join(chunks(src))
        finally:
            src.close()
    return out


def test_walk_lists_regular_files_sorted_and_skips_links_and_fifos(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    step = ckpts / "step-1"
    write(step / "b.bin", b"bb")
    write(step / "a/z.bin", b"z")
    write(step / "é.bin", b"e")
    os.symlink("/etc/passwd", step / "link")
    os.symlink("/etc", step / "dirlink")
    os.mkfifo(step / "fifo")
    fd = folder.open_sub("checkpoints")
    try:
        look = walk(fd, "step-1")
    finally:
        os.close(fd)
    assert [f[0] for f in look.files] == ["a/z.bin", "b.bin", "é.bin"]
    assert look.size == 4
    assert {"'link'", "'dirlink'", "'fifo'"} <= set(look.skipped)


def test_marked_folder_taken_once_stable_then_again_when_rewritten(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    w = watcher(folder)
    write(ckpts / "checkpoint-5/model.bin", b"m" * 10)
    assert w.poll() == []  # no mark, not settled
    write(ckpts / "checkpoint-5/trainer_state.json", b"{}")
    assert w.poll() == []  # marked, but changed since the last look
    found = w.poll()
    assert [(f.name, f.version, len(f.files)) for f in found] == [("checkpoint-5", 0, 2)]
    assert w.poll() == []  # taken in this form
    write(ckpts / "checkpoint-5/model.bin", b"M" * 11)
    assert w.poll() == []
    again = w.poll()
    assert [(f.name, f.version) for f in again] == [("checkpoint-5", 1)]


def test_dcp_metadata_and_checkpoint_done_mark_complete(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    w = watcher(folder)
    write(ckpts / "dcp/__0_0.distcp", b"0")
    write(ckpts / "plain/shard-0", b"0")
    w.poll()
    assert w.poll() == []
    write(ckpts / "dcp/.metadata", b"meta")
    checkpoint_done("plain", ckpts)
    assert (ckpts / DONE_DIR / "plain").exists()
    taken = w.poll() + w.poll()  # "plain" was unchanged already: taken at the first look
    assert sorted(f.name for f in taken) == ["dcp", "plain"]
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        checkpoint_done("../x", ckpts)


def test_settle_time_and_the_ranks_exit(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    rules = FolderRules(settle_s=5.0)
    files = (("a", 1, 1, 1),)
    assert not rules.look("x", files, done=False, final=False, now=100.0)
    assert not rules.look("x", files, done=False, final=False, now=104.0)
    assert rules.look("x", files, done=False, final=False, now=105.5)
    rules.taken("x", files)
    grown = (("a", 1, 1, 1), ("b", 1, 1, 2))
    assert not rules.look("x", grown, done=False, final=False, now=106.0)  # a slow writer's 2nd file
    assert rules.look("x", grown, done=False, final=True, now=106.1)  # the ranks exited
    assert rules.taken("x", grown) == 1


def test_a_dcp_save_cut_off_before_its_metadata_is_never_a_checkpoint() -> None:
    """Shards without `.metadata` (the coordinator writes it last): a crashed or killed save.
    Neither settling nor the ranks' exit lists it on node 0, where `.metadata` is written;
    another node's part (shards only, by design) is taken as ever."""
    rules = FolderRules(settle_s=5.0)
    shards = (("__0_0.distcp", 9, 1, 1), ("__1_0.distcp", 9, 1, 2))
    assert not rules.look("epoch-3", shards, done=False, final=False, now=100.0)
    assert not rules.look("epoch-3", shards, done=False, final=False, now=200.0)
    assert not rules.look("epoch-3", shards, done=True, final=True, now=201.0)
    whole = (*shards, (".metadata", 3, 1, 3))
    assert not rules.look("epoch-3", whole, done=False, final=False, now=202.0)
    assert rules.look("epoch-3", whole, done=False, final=False, now=203.0)  # marked, unchanged
    other = FolderRules(settle_s=5.0, lead=False)
    assert other.look("epoch-3", shards, done=False, final=True, now=100.0)


def test_other_nodes_take_what_is_unchanged_over_two_looks(run: tuple[JobFolder, Path]) -> None:
    rules = FolderRules(settle_s=1000.0, lead=False)
    files = (("rng_state_1.pth", 3, 1, 1),)
    assert not rules.look("c", files, done=False, final=False)
    assert rules.busy({"c"}) == ["c"]
    assert rules.look("c", files, done=False, final=False)
    rules.taken("c", files)
    assert rules.busy({"c"}) == []


def test_ignored_names_and_files_are_not_folders(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    w = watcher(folder)
    for name in (".hidden", "x.tmp", "y.partial"):
        write(ckpts / name / "trainer_state.json", b"{}")
    write(ckpts / "file.pt", b"f")
    os.symlink(ckpts / "x.tmp", ckpts / "linked")
    w.poll()
    assert w.poll(final=True) == []


def test_adopted_copy_is_not_taken_unless_it_changes(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    write(ckpts / "step-3/trainer_state.json", b"{}")
    w = watcher(folder)
    w.adopt("step-3")
    w.poll()
    assert w.poll(final=True) == []
    write(ckpts / "step-3/extra", b"x")
    found = w.poll(final=True)
    assert [(f.name, f.version) for f in found] == [("step-3", 1)]


def test_read_is_the_file_seen_once_hashed(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    write(ckpts / "s/trainer_state.json", b"{}")
    write(ckpts / "s/w.bin", os.urandom(3 * 1024 * 1024 + 5))
    w = watcher(folder)
    w.poll()
    (found,) = w.poll()
    got = read_all(w, "s", found.files)
    assert hashlib.sha256(got["w.bin"]).digest() == hashlib.sha256((ckpts / "s/w.bin").read_bytes()).digest()


def test_a_file_swapped_for_a_link_or_fifo_after_the_look_is_not_read(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    write(ckpts / "s/trainer_state.json", b"{}")
    write(ckpts / "s/a.bin", b"a" * 100)
    write(ckpts / "s/b.bin", b"b" * 100)
    write(ckpts / "s/c.bin", b"c" * 100)
    w = watcher(folder)
    w.poll()
    (found,) = w.poll()
    sigs = {f[0]: f for f in found.files}
    (ckpts / "s/a.bin").unlink()
    os.symlink("/etc/shadow", ckpts / "s/a.bin")
    (ckpts / "s/b.bin").unlink()
    os.mkfifo(ckpts / "s/b.bin")  # O_NONBLOCK: the open does not hang
    (ckpts / "s/c.bin").unlink()
    write(ckpts / "s/c.bin", b"c" * 100)  # another file (another inode) under the name
    for name in ("a.bin", "b.bin", "c.bin"):
        with pytest.raises(CheckpointChanged):
            w.open_file("s", sigs[name])


def test_a_folder_swapped_for_a_link_is_not_followed(run: tuple[JobFolder, Path], tmp_path: Path) -> None:
    folder, ckpts = run
    outside = tmp_path / "outside"
    write(outside / "secret", b"s")
    write(ckpts / "s/trainer_state.json", b"{}")
    write(ckpts / "s/sub/f", b"f")
    w = watcher(folder)
    w.poll()
    (found,) = w.poll()
    sig = next(f for f in found.files if f[0] == "sub/f")
    (ckpts / "s/sub/f").unlink()
    (ckpts / "s/sub").rmdir()
    os.symlink(outside, ckpts / "s/sub")
    with pytest.raises(CheckpointChanged):
        w.open_file("s", (sig[0].replace("f", "secret"), *sig[1:]))
    # and the next look does not walk into the link
    w.poll()
    assert all(not f[0].startswith("sub/") for f in walk(folder.open_sub("checkpoints"), "s").files)


def test_a_grown_or_shrunk_file_reads_only_what_was_seen_or_fails(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    write(ckpts / "s/trainer_state.json", b"{}")
    write(ckpts / "s/g.bin", b"g" * 10)
    w = watcher(folder)
    w.poll()
    (found,) = w.poll()
    sig = next(f for f in found.files if f[0] == "g.bin")
    src = w.open_file("s", sig)
    with open(ckpts / "s/g.bin", "r+b") as fh:  # same inode, truncated after the check
        fh.truncate(3)
    with pytest.raises(CheckpointChanged):
        b"".join(chunks(src))
    src.close()


def test_too_many_files_refused_and_said(
    run: tuple[JobFolder, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, ckpts = run
    monkeypatch.setattr("workers.launcher.folders.MAX_FOLDER_FILES", 3)
    for i in range(5):
        write(ckpts / f"big/{i}", b"x")
    w = watcher(folder)
    assert w.poll(final=True) == []
    assert any("more than 3 files" in r for r in w.take_refusals())
    fd = folder.open_sub("checkpoints")
    try:
        with pytest.raises(FolderRefused):
            walk(fd, "big")
    finally:
        os.close(fd)


def test_sparse_files_and_folders_past_the_limit_are_not_taken(run: tuple[JobFolder, Path]) -> None:
    folder, ckpts = run
    write(ckpts / "s/real.bin", b"r")
    with open(ckpts / "s/holes.bin", "wb") as fh:
        fh.truncate(1 << 40)  # a terabyte of nothing: never read
    write(ckpts / "big/a.bin", b"x" * 2000)
    w = FolderWatcher(folder, "checkpoints", FolderRules(settle_s=1000.0), max_bytes=1000)
    found = {f.name: [p[0] for p in f.files] for f in w.poll(final=True)}
    assert found == {"s": ["real.bin"]}
    assert any("big" in r and "more than the node may keep" in r for r in w.take_refusals())


def test_staging_a_folder_checks_every_file_and_is_cached(tmp_path: Path) -> None:
    from service.storage import Storage
    from workers.launcher.staging import StagingFailed, place_copy, stage_folder

    storage = Storage(f"file://{tmp_path / 'store'}")
    files = []
    for path, data in (("a.bin", b"a"), ("sub/b.bin", b"bb")):
        size, sha = storage.put_stream(iter([data]), f"k/{path}")
        files.append((path, size, sha, f"k/{path}"))
    cache = tmp_path / "cache"
    staged = stage_folder(storage, cache, 7, "step-1", files)
    assert staged == cache / "folder-7" / "step-1"
    assert (staged / "sub/b.bin").read_bytes() == b"bb"
    assert not os.access(staged / "a.bin", os.W_OK) or os.geteuid() == 0
    assert (staged / "a.bin").stat().st_mode & 0o777 == 0o444
    storage.delete("k/a.bin")  # cached: not fetched again
    assert stage_folder(storage, cache, 7, "step-1", files) == staged
    bad = [(files[1][0], files[1][1], "0" * 64, files[1][3])]
    with pytest.raises(StagingFailed, match="SHA-256"):
        stage_folder(storage, cache, 8, "x", bad)
    with pytest.raises(StagingFailed, match="leaves its folder"):
        stage_folder(storage, cache, 9, "x", [("../evil", 1, files[1][2], files[1][3])])
    assert sorted(p.name for p in cache.iterdir()) == ["folder-7"]  # nothing half staged is left
    run_ckpts = tmp_path / "run"
    run_ckpts.mkdir()
    assert place_copy(staged, run_ckpts, "step-1", None)
    assert (run_ckpts / "step-1/sub/b.bin").read_bytes() == b"bb"
    assert (run_ckpts / "step-1/a.bin").stat().st_mode & 0o777 == 0o644
    assert not place_copy(staged, run_ckpts, "../x", None)


def test_staged_folders_are_pruned_least_recently_used_first_but_not_while_in_use(tmp_path: Path) -> None:
    from service.storage import Storage
    from workers.launcher.staging import prune_folders, stage_folder

    storage = Storage(f"file://{tmp_path / 'store'}")
    size, sha = storage.put_stream(iter([b"x" * 1000]), "k/w.bin")
    files = [("w.bin", size, sha, "k/w.bin")]
    cache = tmp_path / "cache"
    staged = {i: stage_folder(storage, cache, i, f"step-{i}", files).parent for i in (1, 2, 3)}
    for i, folder in staged.items():  # used an hour or more ago, 3 the most recently
        os.utime(folder, (1_000_000 + i, 1_000_000 + i))
    (cache / "x.pt").write_bytes(b"y" * 500)  # a file checkpoint counts in the same cap
    prune_folders(cache, 2600, keep=staged[3])
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == ["folder-2", "folder-3"]
    os.utime(staged[2])  # just used: a node may be reading it
    prune_folders(cache, 0, keep=staged[3])
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == ["folder-2", "folder-3"]
    prune_folders(cache, 0, keep=staged[3], min_idle_s=0)
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".pt")) == ["folder-3"]


def test_folders_found_in_one_look_come_oldest_save_first(run: tuple[JobFolder, Path]) -> None:
    """By name `checkpoint-1000` comes before `checkpoint-500`; found in the same look (the
    ranks' exit), they are stored and listed in the order they were saved."""
    folder, ckpts = run
    for name, mtime in (("checkpoint-500", 1_000_000), ("checkpoint-1000", 2_000_000)):
        write(ckpts / name / "model.bin", b"m")
        os.utime(ckpts / name / "model.bin", (mtime, mtime))
    found = watcher(folder).poll(final=True)
    assert [f.name for f in found] == ["checkpoint-500", "checkpoint-1000"]
