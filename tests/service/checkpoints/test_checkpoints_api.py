"""Checkpoints end to end, against real server and worker processes, on file:// and on s3://.

Jobs run `tests/scripts/resume_probe.py`, which reports the SHA-256 of every checkpoint file
its rank wrote and what it was handed as TORCHJOBS_RESUME_FROM.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from service.testing import harness
from tests.service.checkpoints.conftest import KEEP_LAST, UPLOAD_LIMIT, CkptStack

assert KEEP_LAST == 2

pytestmark = pytest.mark.timeout(240)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def probe_spec(count: int, resume_from: dict[str, int] | None = None, mib: float = 3) -> dict[str, Any]:
    return {
        "mode": "single",
        "gpus_per_node": 1,
        "entrypoint": {
            "kind": "script",
            "path": "resume_probe.py",
            "args": ["--count", str(count), "--mib", str(mib)],
        },
        "resume_from": resume_from,
    }


def run_job(cs: CkptStack, spec: dict[str, Any], user: str = "alice") -> dict[str, Any]:
    job = cs.stack.submit(spec, token=cs.users[user])
    done = cs.stack.wait_job(job["id"], timeout=150)
    assert done["state"] == "succeeded", (done, cs.stack.logs_of("up" if cs.kind == "file" else "server"))
    return done


def progress_events(cs: CkptStack, job_id: int) -> list[dict[str, Any]]:
    return [e["data"] for e in cs.stack.events(job_id) if e["type"] == "progress"]


def storage_keys(cs: CkptStack, prefix: str) -> list[str]:
    return cs.storage.list(prefix)


def upload_tmp_files(cs: CkptStack) -> list[str]:
    folder = cs.stack.home / "tmp" / "uploads"
    return sorted(os.listdir(folder)) if folder.exists() else []


@pytest.fixture(scope="module")
def first_job(ckpt_stack: CkptStack) -> dict[str, Any]:
    """One job of alice's that wrote one ~3 MiB checkpoint, and the SHA-256 its rank reported."""
    job = run_job(ckpt_stack, probe_spec(count=1))
    reported = [e for e in progress_events(ckpt_stack, job["id"]) if e.get("ckpt_sha256")]
    assert len(reported) == 1
    with ckpt_stack.client("alice") as c:
        items = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
    assert len(items) == 1
    return {"job": job, "ckpt": items[0], "rank_sha256": reported[0]["ckpt_sha256"]}


def test_download_equals_what_the_rank_wrote(ckpt_stack: CkptStack, first_job: dict[str, Any]) -> None:
    ckpt, job = first_job["ckpt"], first_job["job"]
    assert ckpt["job_id"] == job["id"] and ckpt["name"] == "epoch-0001.pt"
    assert (ckpt["epoch"], ckpt["step"]) == (1, 10)
    assert ckpt["sha256"] == first_job["rank_sha256"]
    assert ckpt["download_url"] == f"/v1/checkpoints/{ckpt['id']}/download"
    assert job["latest_checkpoint"]["id"] == ckpt["id"]
    events = [e for e in ckpt_stack.stack.events(job["id"]) if e["type"] == "checkpoint"]
    assert [e["data"]["id"] for e in events] == [ckpt["id"]]

    with ckpt_stack.client("alice") as c:
        assert c.get(f"/v1/checkpoints/{ckpt['id']}").json() == ckpt
        resp = c.get(ckpt["download_url"])
        assert resp.status_code == 200
        body = resp.content
        assert sha(body) == first_job["rank_sha256"] and len(body) == ckpt["size_bytes"] > 3 * 1024 * 1024
        h = resp.headers
        assert h["content-length"] == str(ckpt["size_bytes"])
        assert h["accept-ranges"] == "bytes"
        assert h["etag"] == f'"{ckpt["sha256"]}"'
        assert h["x-checksum-sha256"] == ckpt["sha256"]
        assert h["content-type"] == "application/octet-stream"

        head = c.head(ckpt["download_url"])
        assert head.status_code == 200 and head.headers["content-length"] == str(len(body))


def test_ranges(ckpt_stack: CkptStack, first_job: dict[str, Any]) -> None:
    ckpt = first_job["ckpt"]
    url, size = ckpt["download_url"], ckpt["size_bytes"]
    with ckpt_stack.client("alice") as c:
        body = c.get(url).content
        cuts = [0, 1, 1024 * 1024 - 1, 1024 * 1024 + 17, size // 2, size - 5, size]
        pieces = []
        for start, end in zip(cuts, cuts[1:], strict=False):
            r = c.get(url, headers={"Range": f"bytes={start}-{end - 1}"})
            assert r.status_code == 206, (start, end, r.text)
            assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{size}"
            assert r.headers["content-length"] == str(end - start)
            assert r.headers["etag"] == f'"{ckpt["sha256"]}"'
            pieces.append(r.content)
        assert b"".join(pieces) == body

        open_ended = c.get(url, headers={"Range": f"bytes={size - 1000}-"})
        assert open_ended.status_code == 206 and open_ended.content == body[-1000:]
        suffix = c.get(url, headers={"Range": "bytes=-777"})
        assert suffix.status_code == 206 and suffix.content == body[-777:]
        past_end = c.get(url, headers={"Range": f"bytes=10-{size + 10_000}"})
        assert past_end.status_code == 206 and past_end.content == body[10:]

        for impossible in (f"bytes={size}-", f"bytes={size + 5}-{size + 10}", "bytes=-0"):
            r = c.get(url, headers={"Range": impossible})
            assert r.status_code == 416, impossible
            assert r.headers["content-range"] == f"bytes */{size}"

        # If-Range: a partial copy of another file gets this one whole; of this one, the range.
        stale = c.get(url, headers={"Range": "bytes=100-", "If-Range": '"' + "0" * 64 + '"'})
        assert stale.status_code == 200 and stale.content == body
        fresh = c.get(url, headers={"Range": "bytes=100-", "If-Range": f'"{ckpt["sha256"]}"'})
        assert fresh.status_code == 206 and fresh.content == body[100:]
        # Ranges we do not serve are ignored, never an error: the whole file.
        for ignored in ("bytes=0-1,5-9", "items=0-3", "bytes=abc"):
            r = c.get(url, headers={"Range": ignored})
            assert r.status_code == 200 and r.content == body, ignored
        assert c.get(url, headers={"If-None-Match": f'"{ckpt["sha256"]}"'}).status_code == 304


def _cli_download(cs: CkptStack, ckpt_id: int, dest: Path) -> subprocess.CompletedProcess[str]:
    env = {**cs.stack.env, "TORCHJOBS_URL": cs.stack.url, "TORCHJOBS_TOKEN": cs.users["alice"]}
    return subprocess.run(
        harness.torchjobs_cmd("download", str(ckpt_id), "-o", str(dest), "--output", "json"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_resumes_an_interrupted_download(
    ckpt_stack: CkptStack, first_job: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = first_job["ckpt"]
    with ckpt_stack.client("alice") as c:
        body = c.get(ckpt["download_url"]).content
    dest = tmp_path / "resumed.pt"
    Path(str(dest) + ".partial").write_bytes(body[: 1024 * 1024 + 12345])  # the connection died here
    proc = _cli_download(ckpt_stack, ckpt["id"], dest)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result == {"id": ckpt["id"], "path": str(dest), "sha256": ckpt["sha256"], "verified": True}
    assert sha(dest.read_bytes()) == first_job["rank_sha256"]
    assert not Path(str(dest) + ".partial").exists()

    # A partial file that is not a prefix of this checkpoint fails the check and is fetched anew.
    other = tmp_path / "other.pt"
    Path(str(other) + ".partial").write_bytes(b"\0" * 50_000)
    proc = _cli_download(ckpt_stack, ckpt["id"], other)
    assert proc.returncode == 0, proc.stderr
    assert other.read_bytes() == body


class OpensAFile:
    """Unpickling this calls open(marker, "w"): it would create the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


class RunsAShellCommand:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_uploads_that_would_run_code_are_refused(ckpt_stack: CkptStack, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    as_torch = io.BytesIO()
    torch.save({"state_dict": {"net": {"w": torch.ones(2)}}, "epoch": OpensAFile(str(marker))}, as_torch)
    files = {
        "torch-save.pt": as_torch.getvalue(),
        "plain.pkl": pickle.dumps({"state_dict": RunsAShellCommand(str(marker))}),
        "random.bin": os.urandom(100_000),
    }
    refusals = {}
    with ckpt_stack.client("alice") as c:
        for name, data in files.items():
            resp = c.post(
                "/v1/checkpoints",
                params={"name": name},
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
            assert resp.status_code == 422, (name, resp.text)
            assert resp.json()["detail"][0]["loc"] == ["body"]
            refusals[name] = resp.json()["detail"][0]["msg"]
    assert "weights_only=True" in refusals["torch-save.pt"]
    assert "nothing in it ran" in refusals["torch-save.pt"]
    assert not marker.exists()
    assert storage_keys(ckpt_stack, "uploads") == []
    assert upload_tmp_files(ckpt_stack) == []


def _raw_post(cs: CkptStack, head: bytes, body: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", cs.stack.port), timeout=30) as s:
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_upload_past_the_limit_is_413_and_leaves_nothing(ckpt_stack: CkptStack) -> None:
    auth = f"Authorization: Bearer {ckpt_stack.users['alice']}\r\n".encode()
    declared = (
        b"POST /v1/checkpoints?name=big.pt HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: "
        b"application/octet-stream\r\nContent-Length: " + str(UPLOAD_LIMIT + 1).encode() + b"\r\n\r\n"
    )
    assert _raw_post(ckpt_stack, declared, b"").startswith(b"HTTP/1.1 413")
    # A chunked body declares nothing: it is counted as it streams, and cut off past the limit.
    chunked = (
        b"POST /v1/checkpoints?name=big.pt HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: "
        b"application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    size = UPLOAD_LIMIT + 1
    body = f"{size:x}\r\n".encode() + b"\1" * size
    assert _raw_post(ckpt_stack, chunked, body).startswith(b"HTTP/1.1 413")
    assert storage_keys(ckpt_stack, "uploads") == []
    assert upload_tmp_files(ckpt_stack) == []


@pytest.fixture(scope="module")
def uploaded(ckpt_stack: CkptStack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Alice's own checkpoint after epoch 3, uploaded through the CLI."""
    path = Path(tmp_path_factory.mktemp("upload")) / "mine.pt"
    net = {"layer.weight": torch.randn(64, 32), "layer.bias": torch.zeros(64)}
    torch.save({"state_dict": {"net": net}, "epoch": 3, "step": 30}, path)
    env = {
        **ckpt_stack.stack.env,
        "TORCHJOBS_URL": ckpt_stack.stack.url,
        "TORCHJOBS_TOKEN": ckpt_stack.users["alice"],
    }
    proc = subprocess.run(
        harness.torchjobs_cmd("upload", str(path), "--output", "json"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return {"ckpt": json.loads(proc.stdout), "bytes": path.read_bytes()}


def test_valid_upload_is_recorded_and_served(ckpt_stack: CkptStack, uploaded: dict[str, Any]) -> None:
    ckpt = uploaded["ckpt"]
    assert ckpt["job_id"] is None and ckpt["name"] == "mine.pt"
    assert (ckpt["epoch"], ckpt["step"]) == (3, 30)
    assert ckpt["size_bytes"] == len(uploaded["bytes"]) and ckpt["sha256"] == sha(uploaded["bytes"])
    with ckpt_stack.client("alice") as c:
        assert c.get(ckpt["download_url"]).content == uploaded["bytes"]
        bare = io.BytesIO()
        torch.save({"w": torch.ones(3)}, bare)  # a bare state dict: accepted, no epoch or step
        resp = c.post("/v1/checkpoints", params={"name": "dir/../bare.pt"}, content=bare.getvalue())
        assert resp.status_code == 201, resp.text
        assert (resp.json()["name"], resp.json()["epoch"], resp.json()["step"]) == ("bare.pt", None, None)
    assert len(storage_keys(ckpt_stack, "uploads")) == 2
    assert upload_tmp_files(ckpt_stack) == []


def test_resume_from_an_upload_and_from_a_job(ckpt_stack: CkptStack, uploaded: dict[str, Any]) -> None:
    up = uploaded["ckpt"]
    job = run_job(ckpt_stack, probe_spec(count=3, resume_from={"checkpoint_id": up["id"]}, mib=0.5))
    start = progress_events(ckpt_stack, job["id"])[0]
    assert (start["resumed_epoch"], start["resumed_sha256"]) == (3, up["sha256"])
    assert job["resume_from"] == {"checkpoint_id": up["id"]}

    # Retention keeps the newest KEEP_LAST of the job's own; the upload it resumed from stays.
    with ckpt_stack.client("alice") as c:
        items = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
        assert [i["epoch"] for i in items] == [5, 6]  # 4 went: KEEP_LAST is 2
        assert c.get(f"/v1/checkpoints/{up['id']}").status_code == 200
    kept = storage_keys(ckpt_stack, f"jobs/{job['id']}")
    assert sorted(k.rsplit("/", 1)[1] for k in kept) == ["epoch-0005.pt", "epoch-0006.pt"]

    latest = items[-1]
    after = run_job(ckpt_stack, probe_spec(count=1, resume_from={"job_id": job["id"]}, mib=0.5))
    start = progress_events(ckpt_stack, after["id"])[0]
    assert (start["resumed_epoch"], start["resumed_sha256"]) == (6, latest["sha256"])
    with ckpt_stack.client("alice") as c:
        items = c.get(f"/v1/jobs/{after['id']}/checkpoints").json()["items"]
    assert [(i["epoch"], i["step"]) for i in items] == [(7, 70)]


def test_resuming_from_a_file_that_needs_a_full_unpickle_is_a_422_at_submit(
    ckpt_stack: CkptStack, tmp_path: Path
) -> None:
    """Contract §5: a script's checkpoint that weights_only=True refuses is refused when a job
    names it, by checkpoint id or by job id, before any job exists; nothing in it runs."""
    marker = tmp_path / "unpickled"
    script = {"kind": "script", "path": "unsafe_checkpoint.py", "args": [str(marker)]}
    job = run_job(ckpt_stack, {"mode": "single", "gpus_per_node": 1, "entrypoint": script})
    with ckpt_stack.client("alice") as c:
        (item,) = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
        before = [j["id"] for j in c.get("/v1/jobs", params={"limit": 500}).json()["items"]]
        named_by = [({"checkpoint_id": item["id"]}, "checkpoint_id"), ({"job_id": job["id"]}, "job_id")]
        for _ in range(2):  # the second time from the remembered verdict
            for resume, field in named_by:
                r = c.post("/v1/jobs", json=probe_spec(count=1, resume_from=resume))
                assert r.status_code == 422, r.text
                detail = r.json()["detail"][0]
                assert detail["loc"][-2:] == ["resume_from", field]
                assert f"checkpoint {item['id']} cannot be resumed from" in detail["msg"]
                assert "weights_only=True" in detail["msg"]
        assert [j["id"] for j in c.get("/v1/jobs", params={"limit": 500}).json()["items"]] == before
    assert not marker.exists()


def test_other_users_checkpoints_do_not_exist_for_them(
    ckpt_stack: CkptStack, first_job: dict[str, Any], uploaded: dict[str, Any]
) -> None:
    mine, up, job_id = first_job["ckpt"], uploaded["ckpt"], first_job["job"]["id"]
    missing = 10**9
    with ckpt_stack.client("bob") as bob:
        unknown = bob.get(f"/v1/checkpoints/{missing}")
        assert unknown.status_code == 404
        for ckpt_id in (mine["id"], up["id"]):
            r = bob.get(f"/v1/checkpoints/{ckpt_id}")
            assert (r.status_code, r.json()) == (404, unknown.json())
            d = bob.get(f"/v1/checkpoints/{ckpt_id}/download")
            assert (d.status_code, d.json()) == (404, bob.get(f"/v1/checkpoints/{missing}/download").json())
            ranged = bob.get(f"/v1/checkpoints/{ckpt_id}/download", headers={"Range": "bytes=0-9"})
            assert ranged.status_code == 404
        listing = bob.get(f"/v1/jobs/{job_id}/checkpoints")
        assert (listing.status_code, listing.json()) == (
            404,
            bob.get(f"/v1/jobs/{missing}/checkpoints").json(),
        )
        for resume, field in (({"checkpoint_id": up["id"]}, "checkpoint_id"), ({"job_id": job_id}, "job_id")):
            r = bob.post("/v1/jobs", json=probe_spec(count=1, resume_from=resume))
            assert r.status_code == 422, r.text
            assert r.json()["detail"][0]["loc"][-2:] == ["resume_from", field]
    with ckpt_stack.stack.client() as admin:
        assert admin.get(f"/v1/checkpoints/{up['id']}").json()["sha256"] == up["sha256"]
        assert admin.get(up["download_url"]).content == uploaded["bytes"]
    with ckpt_stack.client() as c:
        c.headers.pop("Authorization")
        assert c.get(up["download_url"]).status_code == 401
        assert c.post("/v1/checkpoints", content=b"x").status_code == 401
