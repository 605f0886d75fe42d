"""Downloading a folder checkpoint (contract §11) file by file, with the Python client and with
`torchjobs download`: into DIR/NAME/, resumed, every file and the manifest verified, and a
listing whose paths would leave DIR refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.client.download import ChecksumMismatch, UnsafeListing, download_checkpoint
from service.models import Checkpoint
from service.testing import harness
from tests.service.checkpoint_folders.conftest import Env, make_folder, sha

BIG = os.urandom(2 * 1024 * 1024 + 333)
FILES = {
    "trainer_state.json": b'{"global_step": 500}\n',
    "model.safetensors": BIG,
    "rng/rng_state_0.pth": os.urandom(4000),
    "rng/rng_state_1.pth": os.urandom(4001),
    "empty": b"",
}


@pytest.fixture
def alice(env: Env) -> Iterator[TestClient]:
    """The app as alice sees it, as the `httpx.Client` the download functions take."""
    with TestClient(env.api.app, headers=env.headers("alice")) as client:
        yield client


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_folder_is_fetched_file_by_file_and_verified(env: Env, alice: TestClient, tmp_path: Path) -> None:
    meta = make_folder(env, "alice", "checkpoint-500", FILES)
    seen: list[tuple[int, int]] = []
    got = download_checkpoint(alice, meta["id"], meta, str(tmp_path), lambda d, t: seen.append((d, t)))
    assert got == meta["sha256"]
    assert files_under(tmp_path / "checkpoint-500") == FILES
    assert seen[-1] == (meta["size_bytes"], meta["size_bytes"])


def test_it_resumes_partial_files_and_keeps_finished_ones(
    env: Env, alice: TestClient, tmp_path: Path
) -> None:
    meta = make_folder(env, "alice", "resumable", FILES)
    root = tmp_path / "resumable"
    (root / "rng").mkdir(parents=True)
    kept = root / "trainer_state.json"
    kept.write_bytes(FILES["trainer_state.json"])
    inode = kept.stat().st_ino
    (root / "model.safetensors.partial").write_bytes(BIG[: 1024 * 1024 + 7])  # the connection died here
    (root / "rng" / "rng_state_0.pth.partial").write_bytes(b"\0" * 100)  # not this file's bytes
    (root / "rng" / "rng_state_1.pth").write_bytes(b"stale copy of another run")
    assert download_checkpoint(alice, meta["id"], meta, str(tmp_path)) == meta["sha256"]
    assert files_under(root) == FILES
    assert kept.stat().st_ino == inode  # verified in place, not fetched again


def test_a_corrupted_stored_file_is_detected(env: Env, alice: TestClient, tmp_path: Path) -> None:
    meta = make_folder(env, "alice", "corrupt", FILES)
    with env.db.read() as session:
        from service.models import CheckpointFile

        row = (
            session.query(CheckpointFile)
            .filter_by(checkpoint_id=meta["id"], path="rng/rng_state_1.pth")
            .one()
        )
        key = row.storage_key
    env.storage.put_stream(iter([os.urandom(4001)]), key)  # same size, other bytes
    with pytest.raises(ChecksumMismatch, match="rng_state_1.pth"):
        download_checkpoint(alice, meta["id"], meta, str(tmp_path))
    left = files_under(tmp_path / "corrupt")
    assert "rng/rng_state_1.pth" not in left and "rng/rng_state_1.pth.partial" not in left


def test_a_listing_that_does_not_hash_to_the_checkpoint_is_refused(
    env: Env, alice: TestClient, tmp_path: Path
) -> None:
    meta = make_folder(env, "alice", "tampered", FILES)
    with env.db.transaction() as session:
        ckpt = session.get(Checkpoint, meta["id"])
        assert ckpt is not None
        ckpt.sha256 = "0" * 64
    meta = alice.get(f"/v1/checkpoints/{meta['id']}").json()
    with pytest.raises(ChecksumMismatch, match="file list"):
        download_checkpoint(alice, meta["id"], meta, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", ["../escape.txt", "a/../../escape.txt", "/tmp/abs.txt", "a//b", "a\\..\\b"])
def test_paths_that_would_escape_are_refused(env: Env, alice: TestClient, tmp_path: Path, path: str) -> None:
    meta = make_folder(env, "alice", "hostile", {"ok.txt": b"ok", path: b"x"})
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(UnsafeListing):
        download_checkpoint(alice, meta["id"], meta, str(dest))
    assert list(tmp_path.rglob("*")) == [dest]


def test_a_link_on_disk_does_not_lead_a_file_outside(env: Env, alice: TestClient, tmp_path: Path) -> None:
    meta = make_folder(env, "alice", "linked", {"sub/f.txt": b"data"})
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "dest" / "linked").mkdir(parents=True)
    (tmp_path / "dest" / "linked" / "sub").symlink_to(outside)
    with pytest.raises(UnsafeListing):
        download_checkpoint(alice, meta["id"], meta, str(tmp_path / "dest"))
    assert list(outside.iterdir()) == []


# -- the command --------------------------------------------------------------------------
# Run over one of the two setups: it is the same client code as above, which runs on both, in
# a process of its own (each start costs seconds).
ONE_SETUP = pytest.mark.parametrize("env", ["sqlite-file"], indirect=True)


def cli_download(env: Env, url: str, ckpt_id: int, dest: Path) -> subprocess.CompletedProcess[str]:
    token = env.headers("alice")["Authorization"].split()[1]
    environ = {
        **os.environ,
        "TORCHJOBS_URL": url,
        "TORCHJOBS_TOKEN": token,
        "TORCHJOBS_HOME": str(dest.parent),
    }
    return subprocess.run(
        harness.torchjobs_cmd("download", str(ckpt_id), "-o", str(dest), "--output", "json"),
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


@ONE_SETUP
def test_the_command_downloads_resumes_and_verifies_a_folder(env: Env, served: str, tmp_path: Path) -> None:
    meta = make_folder(env, "alice", "checkpoint-9", FILES)
    dest = tmp_path / "out"
    root = dest / "checkpoint-9"
    root.mkdir(parents=True)
    (root / "model.safetensors.partial").write_bytes(BIG[:12345])
    proc = cli_download(env, served, meta["id"], dest)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    assert result == {"id": meta["id"], "path": str(root), "sha256": meta["sha256"], "verified": True}
    assert files_under(root) == FILES

    broken = make_folder(env, "alice", "broken", FILES)
    with env.db.transaction() as session:
        from service.models import CheckpointFile

        row = (
            session.query(CheckpointFile)
            .filter_by(checkpoint_id=broken["id"], path="model.safetensors")
            .one()
        )
        env.storage.put_stream(iter([BIG[:-1] + b"?"]), row.storage_key)
    proc = cli_download(env, served, broken["id"], dest)
    assert proc.returncode == 1 and "model.safetensors" in proc.stderr
    assert not (dest / "broken" / "model.safetensors").exists()


@ONE_SETUP
def test_the_command_still_downloads_a_file(env: Env, served: str, tmp_path: Path) -> None:
    data = os.urandom(70_000)
    env.storage.put_stream(iter([data]), "uploads/cli/one.pt")
    with env.db.transaction() as session:
        ckpt = Checkpoint(
            owner_id=env.users["alice"][0],
            name="one.pt",
            size_bytes=len(data),
            sha256=sha(data),
            storage_key="uploads/cli/one.pt",
            metrics={},
        )
        session.add(ckpt)
        session.flush()
        ckpt_id = ckpt.id
    dest = tmp_path / "one-copy.pt"
    Path(str(dest) + ".partial").write_bytes(data[:1000])
    proc = cli_download(env, served, ckpt_id, dest)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["path"] == str(dest) and dest.read_bytes() == data
