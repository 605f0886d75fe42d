"""Uploading a folder checkpoint as a tar or gzip tar (contract §11): checked as code archives
are (§6), every hostile member refused with a 422 that names it and nothing kept anywhere; a
good one becomes a folder checkpoint served like any other."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from service.checkpoints.manifest import manifest_of
from service.client.api import Client
from service.client.folder_pack import folder_files, packed_chunks
from service.models import Checkpoint, CheckpointFile
from service.testing import harness
from tests.service.checkpoint_folders.conftest import MEMBERS_LIMIT, UPLOAD_LIMIT, Env, sha


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def archive(*members: tuple[tarfile.TarInfo, bytes | None], gz: bool = False) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return gzip.compress(raw.getvalue(), mtime=0) if gz else raw.getvalue()


def upload(env: Env, body: bytes, content_type: str, **params: str) -> httpx.Response:
    return env.api.post(
        "/v1/checkpoints",
        params=params,
        content=body,
        headers={**env.headers("bob"), "Content-Type": content_type},
    )


def kept(env: Env) -> tuple[list[str], int, list[str]]:
    """What a refused upload must not leave: stored objects, rows, temporary files."""
    with env.db.read() as session:
        rows = session.execute(select(func.count()).select_from(Checkpoint)).scalar_one()
        rows += session.execute(select(func.count()).select_from(CheckpointFile)).scalar_one()
    tmp = env.settings.home / "tmp" / "uploads"
    return env.storage.list("uploads"), rows, sorted(p.name for p in tmp.glob("*")) if tmp.exists() else []


WEIGHTS = os.urandom(300_000)
GOOD = {
    "config.json": b'{"hidden": 8}\n',
    "model.safetensors": WEIGHTS,
    "optimizer.pt": b"not unpickled by the server: \x80\x04 junk",
    "rng_state_0.pth": b"r0",
    "rng_state_1.pth": b"r1",
    "sub/dir/x.bin": b"",
}


def test_a_tar_of_a_folder_is_a_folder_checkpoint(env: Env) -> None:
    body = archive(
        (member("checkpoint-7", tarfile.DIRTYPE), None),
        *((member(f"checkpoint-7/{p}"), d) for p, d in GOOD.items()),
    )
    resp = upload(env, body, "application/x-tar")
    assert resp.status_code == 201, resp.text
    ckpt = resp.json()
    _, manifest_sha = manifest_of([(p, len(d), sha(d)) for p, d in GOOD.items()])
    assert (ckpt["kind"], ckpt["files"], ckpt["name"], ckpt["job_id"]) == (
        "folder",
        len(GOOD),
        "checkpoint-7",
        None,
    )
    assert ckpt["sha256"] == manifest_sha and ckpt["size_bytes"] == sum(len(d) for d in GOOD.values())

    h = env.headers("bob")
    listed = env.api.get(f"/v1/checkpoints/{ckpt['id']}/files", headers=h).json()["items"]
    assert {i["path"]: (i["size_bytes"], i["sha256"]) for i in listed} == {
        p: (len(d), sha(d)) for p, d in GOOD.items()
    }
    one = env.api.get(f"/v1/checkpoints/{ckpt['id']}/files/model.safetensors", headers=h)
    assert one.content == WEIGHTS

    # Its own download, uploaded again, is the same checkpoint: name, paths, manifest.
    tar_body = env.api.get(ckpt["download_url"], headers=h).content
    again = upload(env, tar_body, "application/x-tar").json()
    assert (again["name"], again["sha256"], again["files"]) == ("checkpoint-7", manifest_sha, len(GOOD))
    assert env.api.get(again["download_url"], headers=h).content == tar_body


@pytest.mark.parametrize("content_type", ["application/gzip", "application/x-tar"])
def test_a_gzip_tar_of_loose_files_named_by_the_query(env: Env, content_type: str) -> None:
    body = archive(
        (member("./a.txt"), b"a"), (member("b/c.txt"), b"c"), (member("./b/d//e.txt"), b"e"), gz=True
    )
    resp = upload(env, body, content_type, name="mine")
    assert resp.status_code == 201, resp.text
    ckpt = resp.json()
    assert ckpt["name"] == "mine" and ckpt["files"] == 3
    listed = env.api.get(f"/v1/checkpoints/{ckpt['id']}/files", headers=env.headers("bob")).json()["items"]
    assert [i["path"] for i in listed] == ["a.txt", "b/c.txt", "b/d/e.txt"]


HOSTILE = [
    pytest.param(
        [(member("ok.txt"), b"ok"), (member("link", tarfile.SYMTYPE, "ok.txt"), None)],
        "link",
        id="symlink-inside",
    ),
    pytest.param([(member("etc", tarfile.SYMTYPE, "/etc"), None)], "etc", id="symlink-out"),
    pytest.param(
        [(member("ok.txt"), b"ok"), (member("hard", tarfile.LNKTYPE, "ok.txt"), None)], "hard", id="hardlink"
    ),
    pytest.param([(member("../x"), b"x")], "../x", id="dotdot"),
    pytest.param([(member("a/../../x"), b"x")], "a/../../x", id="dotdot-deep"),
    pytest.param([(member("/abs.txt"), b"x")], "/abs.txt", id="absolute"),
    pytest.param([(member("dev/null", tarfile.CHRTYPE), None)], "dev/null", id="char-device"),
    pytest.param([(member("sda", tarfile.BLKTYPE), None)], "sda", id="block-device"),
    pytest.param([(member("pipe", tarfile.FIFOTYPE), None)], "pipe", id="fifo"),
    pytest.param([(member("a.txt"), b"1"), (member("./a.txt"), b"2")], "./a.txt", id="duplicate"),
    pytest.param([(member("a"), b"1"), (member("a/b"), b"2")], "a/b", id="through-a-file"),
    pytest.param([(member("a\\..\\..\\x"), b"1")], "a\\..\\..\\x", id="backslash-dotdot"),
]


@pytest.mark.parametrize(("members", "named"), HOSTILE)
@pytest.mark.parametrize("gz", [False, True], ids=["tar", "gzip"])
def test_hostile_members_are_refused_by_name(
    env: Env, members: list[tuple[tarfile.TarInfo, bytes | None]], named: str, gz: bool
) -> None:
    before = kept(env)
    resp = upload(env, archive(*members, gz=gz), "application/gzip" if gz else "application/x-tar")
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"][0]
    assert detail["loc"] == ["body", "archive", named] and named in detail["msg"], detail
    assert kept(env) == before


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "not a tar"),
        (b"plain text, not an archive" * 100, "not a tar"),
        (gzip.compress(b"not a tar inside", mtime=0), "not a tar"),
        (archive((member("d", tarfile.DIRTYPE), None)), "no files"),
    ],
    ids=["empty", "text", "gzip-of-text", "folders-only"],  # the same ids in every xdist process
)
def test_what_is_not_a_tar_of_files_is_a_422(env: Env, body: bytes, why: str) -> None:
    before = kept(env)
    resp = upload(env, body, "application/x-tar")
    assert resp.status_code == 422 and why in resp.text, resp.text
    assert kept(env) == before


def test_limits(env: Env) -> None:
    before = kept(env)
    too_big = upload(env, os.urandom(UPLOAD_LIMIT + 1), "application/x-tar")
    assert too_big.status_code == 413, too_big.text
    bomb = archive((member("small"), b"s"), (member("zeros.bin"), b"\0" * (UPLOAD_LIMIT + 1)), gz=True)
    assert len(bomb) < UPLOAD_LIMIT
    resp = upload(env, bomb, "application/gzip")
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "archive", "zeros.bin"]
    many = archive(*((member(f"f{i}"), b"") for i in range(MEMBERS_LIMIT + 1)))
    resp = upload(env, many, "application/x-tar")
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == [
        "body",
        "archive",
        f"f{MEMBERS_LIMIT}",
    ]
    assert kept(env) == before


@pytest.mark.parametrize("env", ["sqlite-file"], indirect=True)  # a torch subprocess: once
def test_a_file_upload_is_unchanged(env: Env) -> None:
    """An octet-stream body is still one file, checked as §5 says (this one is not a torch file)."""
    resp = upload(env, archive((member("a"), b"a")), "application/octet-stream")
    assert resp.status_code == 422, resp.text
    body: Any = resp.json()
    assert body["detail"][0]["type"] == "checkpoint_refused"


# -- the client: a local folder, packed on the fly -------------------------------------------


def test_the_client_uploads_a_folder_and_gets_the_same_tar_back(
    env: Env, served: str, tmp_path: Path
) -> None:
    root = tmp_path / "global_step100"
    (root / "shards").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    files = {
        "latest": b"global_step100\n",
        "shards/mp_rank_00_model_states.pt": os.urandom(1024 * 1024 + 3),
        "shards/zero_pp_rank_1_optim_states.pt": os.urandom(777),
        "ü.json": b"{}",
    }
    for path, data in files.items():
        (root / path).write_bytes(data)
    (root / "link-to-outside").symlink_to("/etc/hostname")  # links are never sent
    (root / "linked-dir").symlink_to(tmp_path)

    token = env.headers("bob")["Authorization"].split()[1]
    with Client(served, token) as client:
        ckpt = client.upload(str(root))
        assert (ckpt["kind"], ckpt["name"], ckpt["files"]) == ("folder", "global_step100", len(files))
        assert ckpt["sha256"] == manifest_of([(p, len(d), sha(d)) for p, d in files.items()])[1]
        listed = client.checkpoint_files(ckpt["id"])
        assert sorted(i["path"] for i in listed) == sorted(files)
        packed = b"".join(packed_chunks("global_step100", folder_files(str(root))))
        assert client.http.get(ckpt["download_url"]).content == packed  # byte for byte
        named = client.upload(str(root), "renamed")
        assert (named["name"], named["sha256"]) == ("renamed", ckpt["sha256"])


@pytest.mark.parametrize("env", ["sqlite-file"], indirect=True)  # the command's own process: once
def test_the_command_uploads_a_folder(env: Env, served: str, tmp_path: Path) -> None:
    root = tmp_path / "checkpoint-3"
    root.mkdir()
    (root / "trainer_state.json").write_bytes(b'{"global_step": 3}')
    token = env.headers("bob")["Authorization"].split()[1]
    environ = {**os.environ, "TORCHJOBS_URL": served, "TORCHJOBS_TOKEN": token}
    environ["TORCHJOBS_HOME"] = str(tmp_path)
    proc = subprocess.run(
        harness.torchjobs_cmd("upload", str(root), "--output", "json"),
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    ckpt = json.loads(proc.stdout)
    assert (ckpt["kind"], ckpt["name"], ckpt["files"]) == ("folder", "checkpoint-3", 1)
    assert ckpt["size_bytes"] == 18


@pytest.mark.parametrize(("name", "expected"), [("..", "upload"), ("a/b/", "b"), ("  spaced  ", "spaced")])
def test_names_are_one_printable_component(env: Env, name: str, expected: str) -> None:
    resp = upload(env, archive((member("x"), b"x")), "application/x-tar", name=name)
    assert resp.status_code == 201, resp.text
    assert resp.json()["name"] == expected
