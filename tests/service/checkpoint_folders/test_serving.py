"""Serving folder checkpoints (contract §11): the file list, one file with Range/ETag/checksum,
and the folder's tar, which is the same bytes every time so that any Range of it is a slice of
the whole."""

from __future__ import annotations

import io
import os
import tarfile
from typing import Any
from urllib.parse import quote

import pytest

from service.checkpoints.manifest import manifest_of
from tests.service.checkpoint_folders.conftest import Env, make_folder, sha

BIG = os.urandom(3 * 1024 * 1024 + 17)  # crosses the 1 MiB read chunks
FILES: dict[str, bytes] = {
    "trainer_state.json": b'{"global_step": 500}\n',
    "model.safetensors": BIG,
    "rng_state_1.pth": b"r1" * 300,
    "rng_state_0.pth": b"r0" * 256,  # exactly 512 bytes: no padding
    "empty.bin": b"",
    "Zeta/upper.txt": b"capital letters sort first in bytes\n",
    "global_step100/" + "d" * 120 + "/shard.pt": b"a path past ustar's 100 bytes\n",
    "übung/é.txt": b"non-ASCII names, sorted by their UTF-8 bytes\n",
    "sub/dir/deep.bin": os.urandom(1000),
}
NODES = {"rng_state_1.pth": 1, "sub/dir/deep.bin": 1}


@pytest.fixture(scope="module")
def folder(env: Env) -> dict[str, Any]:
    return make_folder(env, "alice", "checkpoint-500", FILES, NODES)


def manifest_order() -> list[str]:
    return sorted(FILES, key=lambda p: p.encode())


def test_the_checkpoint_says_it_is_a_folder(env: Env, folder: dict[str, Any]) -> None:
    assert folder["kind"] == "folder" and folder["files"] == len(FILES)
    assert folder["size_bytes"] == sum(len(d) for d in FILES.values())
    _, manifest_sha = manifest_of([(p, len(d), sha(d)) for p, d in FILES.items()])
    assert folder["sha256"] == manifest_sha


def test_files_are_listed_in_manifest_order(env: Env, folder: dict[str, Any]) -> None:
    resp = env.api.get(f"/v1/checkpoints/{folder['id']}/files", headers=env.headers("alice"))
    assert resp.status_code == 200, resp.text
    items = resp.json()["items"]
    assert [i["path"] for i in items] == manifest_order()
    for item in items:
        data = FILES[item["path"]]
        assert item == {
            "path": item["path"],
            "size_bytes": len(data),
            "sha256": sha(data),
            "node_rank": NODES.get(item["path"], 0),
        }


def test_one_file_with_ranges_etag_and_checksum(env: Env, folder: dict[str, Any]) -> None:
    h = env.headers("alice")
    for path, data in FILES.items():
        url = f"/v1/checkpoints/{folder['id']}/files/{quote(path)}"
        whole = env.api.get(url, headers=h)
        assert whole.status_code == 200, (path, whole.text)
        assert whole.content == data
        assert whole.headers["x-checksum-sha256"] == sha(data)
        assert whole.headers["etag"] == f'"{sha(data)}"'
        assert whole.headers["content-length"] == str(len(data))
        assert whole.headers["accept-ranges"] == "bytes"
        assert env.api.get(url, headers={**h, "If-None-Match": f'"{sha(data)}"'}).status_code == 304
        head = env.api.head(url, headers=h)
        assert head.status_code == 200 and head.headers["content-length"] == str(len(data))

    url = f"/v1/checkpoints/{folder['id']}/files/model.safetensors"
    size = len(BIG)
    cuts = [0, 1, 1024 * 1024 - 1, 1024 * 1024 + 5, size - 3, size]
    pieces = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        r = env.api.get(url, headers={**h, "Range": f"bytes={start}-{end - 1}"})
        assert r.status_code == 206 and r.headers["content-range"] == f"bytes {start}-{end - 1}/{size}"
        pieces.append(r.content)
    assert b"".join(pieces) == BIG
    assert env.api.get(url, headers={**h, "Range": "bytes=-10"}).content == BIG[-10:]
    past = env.api.get(url, headers={**h, "Range": f"bytes={size}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{size}"
    stale = env.api.get(url, headers={**h, "Range": "bytes=5-", "If-Range": '"' + "0" * 64 + '"'})
    assert stale.status_code == 200 and stale.content == BIG
    fresh = env.api.get(url, headers={**h, "Range": "bytes=5-", "If-Range": f'"{sha(BIG)}"'})
    assert fresh.status_code == 206 and fresh.content == BIG[5:]
    empty = f"/v1/checkpoints/{folder['id']}/files/empty.bin"
    assert env.api.get(empty, headers={**h, "Range": "bytes=0-"}).status_code == 416


@pytest.mark.parametrize(
    "path",
    ["nope", "sub", "sub/", "sub/dir", "../trainer_state.json", "%00", "x" * 5000, "", "TRAINER_STATE.JSON"],
)
def test_an_unknown_path_is_a_404(env: Env, folder: dict[str, Any], path: str) -> None:
    resp = env.api.get(f"/v1/checkpoints/{folder['id']}/files/{path}", headers=env.headers("alice"))
    assert resp.status_code == 404, resp.text


def test_only_the_owner_and_the_admin_see_them(env: Env, folder: dict[str, Any]) -> None:
    base = f"/v1/checkpoints/{folder['id']}"
    for url in (f"{base}/files", f"{base}/files/trainer_state.json", f"{base}/download"):
        assert env.api.get(url, headers=env.headers("bob")).status_code == 404, url
        assert env.api.get(url).status_code == 401, url
        admin = env.api.get(url, headers={"Authorization": f"Bearer {env.settings.admin_token}"})
        assert admin.status_code == 200, url


def test_a_file_checkpoint_lists_itself(env: Env) -> None:
    data = os.urandom(5000)
    key = "uploads/test/one.pt"
    env.storage.put_stream(iter([data]), key)
    from service.models import Checkpoint

    with env.db.transaction() as session:
        ckpt = Checkpoint(
            owner_id=env.users["alice"][0],
            name="one.pt",
            size_bytes=len(data),
            sha256=sha(data),
            storage_key=key,
            metrics={},
        )
        session.add(ckpt)
        session.flush()
        ckpt_id = ckpt.id
    h = env.headers("alice")
    got = env.api.get(f"/v1/checkpoints/{ckpt_id}", headers=h).json()
    assert (got["kind"], got["files"]) == ("file", 1)
    listed = env.api.get(f"/v1/checkpoints/{ckpt_id}/files", headers=h).json()
    assert listed == {"items": [{"path": "one.pt", "size_bytes": 5000, "sha256": sha(data), "node_rank": 0}]}
    one = env.api.get(f"/v1/checkpoints/{ckpt_id}/files/one.pt", headers={**h, "Range": "bytes=10-19"})
    assert one.status_code == 206 and one.content == data[10:20]
    assert env.api.get(f"/v1/checkpoints/{ckpt_id}/files/other.pt", headers=h).status_code == 404
    download = env.api.get(f"/v1/checkpoints/{ckpt_id}/download", headers=h)
    assert download.content == data and download.headers["content-type"] == "application/octet-stream"


# -- the tar -----------------------------------------------------------------------------


def test_the_tar_is_the_folder_and_the_same_every_time(env: Env, folder: dict[str, Any]) -> None:
    url, h = folder["download_url"], env.headers("alice")
    first = env.api.get(url, headers=h)
    assert first.status_code == 200, first.text
    assert first.headers["content-type"] == "application/x-tar"
    assert first.headers["content-length"] == str(len(first.content))
    assert first.headers["x-checksum-sha256"] == folder["sha256"]
    assert first.headers["etag"] == f'"{folder["sha256"]}"'
    assert env.api.get(url, headers=h).content == first.content
    head = env.api.head(url, headers=h)
    assert head.status_code == 200 and head.headers["content-length"] == str(len(first.content))
    assert env.api.get(url, headers={**h, "If-None-Match": f'"{folder["sha256"]}"'}).status_code == 304

    with tarfile.open(fileobj=io.BytesIO(first.content), mode="r:") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f"checkpoint-500/{p}" for p in manifest_order()]
        for m in members:
            assert m.isreg() and (m.mode, m.mtime, m.uid, m.gid, m.uname, m.gname) == (0o644, 0, 0, 0, "", "")
            extracted = tar.extractfile(m)
            assert extracted is not None
            assert extracted.read() == FILES[m.name.split("/", 1)[1]]


def test_every_range_of_the_tar_is_a_slice_of_it(env: Env, folder: dict[str, Any]) -> None:
    url, h = folder["download_url"], env.headers("alice")
    body = env.api.get(url, headers=h).content
    size = len(body)
    # Cuts inside headers, bodies, padding and the end blocks, and on their edges.
    cuts = sorted(
        {0, 1, 511, 512, 513, 700, 1023, 1024, 1025, 2000, 4096, 1024 * 1024 + 3, size // 2}
        | {size - 1025, size - 1024, size - 513, size - 1, size}
    )
    pieces = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        r = env.api.get(url, headers={**h, "Range": f"bytes={start}-{end - 1}"})
        assert r.status_code == 206, (start, end, r.text)
        assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{size}"
        assert r.content == body[start:end], (start, end)
        pieces.append(r.content)
    assert b"".join(pieces) == body
    for header, want in (("bytes=-700", body[-700:]), (f"bytes={size - 5000}-", body[-5000:])):
        r = env.api.get(url, headers={**h, "Range": header})
        assert r.status_code == 206 and r.content == want, header
    past = env.api.get(url, headers={**h, "Range": f"bytes={size}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{size}"
    stale = env.api.get(url, headers={**h, "Range": "bytes=9-", "If-Range": '"' + "1" * 64 + '"'})
    assert stale.status_code == 200 and stale.content == body


def test_an_empty_folder_is_an_empty_archive(env: Env) -> None:
    ckpt = make_folder(env, "alice", "nothing", {})
    body = env.api.get(ckpt["download_url"], headers=env.headers("alice")).content
    assert body == b"\0" * 1024
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert tar.getmembers() == []


def test_a_stored_path_that_could_escape_is_never_archived(env: Env) -> None:
    ckpt = make_folder(env, "alice", "hostile", {"ok.txt": b"ok", "../escape": b"x"})
    h = env.headers("alice")
    listed = env.api.get(f"/v1/checkpoints/{ckpt['id']}/files", headers=h).json()["items"]
    assert [i["path"] for i in listed] == ["../escape", "ok.txt"]  # listed as data
    assert env.api.get(ckpt["download_url"], headers=h).status_code == 409
