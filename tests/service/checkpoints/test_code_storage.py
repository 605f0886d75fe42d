"""Code archives live in the same storage as checkpoints (contract §6): a file:// folder or an
S3 bucket (a real S3-compatible server). The worker fetches the archive from there, checks its
SHA-256, unpacks it and runs the job in a copy."""

from __future__ import annotations

from pathlib import Path

from service.client import Client
from service.code.service import storage_key
from tests.service.checkpoints.conftest import CkptStack


def test_code_is_stored_once_and_runs_from_the_storage(ckpt_stack: CkptStack, tmp_path: Path) -> None:
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "hello.py").write_text("import os\nprint('hello from', os.getcwd(), flush=True)\n")
    with Client(ckpt_stack.stack.url, ckpt_stack.users["alice"]) as alice:
        code = alice.push_code(folder)
        assert ckpt_stack.storage.exists(storage_key(code["id"]))
        with Client(ckpt_stack.stack.url, ckpt_stack.users["bob"]) as bob:
            assert bob.push_code(folder)["owner"] == "bob"  # a row of bob's own; the same bytes
        entry = {"kind": "script", "path": "hello.py", "args": []}
        job = alice.submit({"mode": "single", "entrypoint": entry, "code": code["id"]})
    done = ckpt_stack.stack.wait_job(job["id"])
    assert done["state"] == "succeeded", ckpt_stack.stack.describe(job["id"])
    with ckpt_stack.client("alice") as c:
        log = c.get(f"/v1/jobs/{job['id']}/logs").text
    assert "hello from" in log and "workdir" in log
    keys = [k for k in ckpt_stack.storage.list("code") if k.endswith(".tar.gz")]
    assert len(keys) == 1
