"""Stacks for the checkpoint suite, one per storage kind.

- `file`: `torchjobs up` (SQLite, embedded broker, local worker) on a `file://` folder.
- `s3`: `torchjobs server` + `torchjobs worker` on PostgreSQL and Redis, storing in a bucket of a
  real S3-compatible server (moto's server mode) on loopback, reached through s3fs.

Both run with a small upload limit and a retention of 2, so the same tests see those too.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from service.storage import Storage
from service.testing import harness

UPLOAD_LIMIT = 8 * 1024 * 1024
KEEP_LAST = 2
BUCKET = "torchjobs-ckpt-test"
# Redis db 15 with a worker name nobody else uses: the queue is `worker.<name>`.
REDIS_DB = 15


@dataclass
class CkptStack:
    kind: str
    stack: harness.Stack
    storage: Storage
    users: dict[str, str]  # name -> token

    def client(self, user: str | None = None) -> Any:
        return self.stack.client(self.users[user] if user else harness.ADMIN_TOKEN)


@pytest.fixture(scope="module")
def s3_server() -> Iterator[dict[str, Any]]:
    """A moto S3 server on a free loopback port, with the test bucket; its fsspec options."""
    from moto.server import ThreadedMotoServer

    port = harness.free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
    }
    import boto3

    boto3.client(
        "s3", aws_access_key_id="testing", aws_secret_access_key="testing", **options["client_kwargs"]
    ).create_bucket(Bucket=BUCKET)
    yield options
    server.stop()


def _base_overrides() -> dict[str, str]:
    return {
        "TORCHJOBS_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT),
        "TORCHJOBS_CHECKPOINT_KEEP_LAST": str(KEEP_LAST),
    }


def _file_stack(home: Path) -> tuple[harness.Stack, Storage]:
    url = f"file://{home / 'ckpt-storage'}"
    env = harness.make_env(home, TORCHJOBS_STORAGE_URL=url, **_base_overrides())
    stack = harness.Stack(home=home, env=env, port=harness.free_port(), embedded=True)
    stack.start_server()
    stack.wait_worker_online("local")
    return stack, Storage(url)


def _s3_stack(home: Path, pg_url: str, options: dict[str, Any]) -> tuple[harness.Stack, Storage]:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/checkpoints"
    env = harness.make_env(
        home,
        TORCHJOBS_DATABASE_URL=pg_url,
        TORCHJOBS_BROKER_URL=f"{harness.REDIS_URL}/{REDIS_DB}",
        TORCHJOBS_STORAGE_URL=url,
        TORCHJOBS_STORAGE_OPTIONS=json.dumps(options),
        **_base_overrides(),
    )
    subprocess.run(harness.torchjobs_cmd("db", "upgrade"), env=env, check=True, capture_output=True)
    stack = harness.Stack(home=home, env=env, port=harness.free_port(), embedded=False)
    stack.start_server()
    stack.start_worker(f"ckpt-{uuid.uuid4().hex[:8]}", gpus=2)
    return stack, Storage(url, **options)


@pytest.fixture(scope="module", params=["file", "s3"])
def ckpt_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CkptStack]:
    home = Path(tmp_path_factory.mktemp(f"ckpt-{request.param}"))
    if request.param == "file":
        stack, storage = _file_stack(home)
    else:
        options = request.getfixturevalue("s3_server")
        stack, storage = _s3_stack(home, request.getfixturevalue("module_pg_url"), options)
    try:
        users = {}
        with stack.client() as admin:
            for name in ("alice", "bob"):
                resp = admin.post("/v1/users", json={"name": name})
                assert resp.status_code == 201, resp.text
                users[name] = resp.json()["token"]
        yield CkptStack(kind=request.param, stack=stack, storage=storage, users=users)
    finally:
        stack.stop()
