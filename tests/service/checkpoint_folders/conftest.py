"""The app in process (FastAPI's TestClient) over a real database and a real storage, twice:
SQLite with `file://` storage, and PostgreSQL with `s3://` storage (moto's S3 server on
loopback, reached through s3fs). No Redis and no worker: folder checkpoints are recorded here
as the taking side records them, rows and stored objects, and then served.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from service.app import create_app
from service.checkpoints.manifest import manifest_of
from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from service.models import Checkpoint, CheckpointFile
from service.storage import Storage
from service.testing import harness

TOKEN = "tj_folders_admin_token_0123456789abcdef"
BUCKET = "torchjobs-folders-test"
UPLOAD_LIMIT = 6 * 1024 * 1024  # the body, and what a folder upload unpacks to
MEMBERS_LIMIT = 200


@dataclass
class Env:
    kind: str
    api: TestClient
    db: Database
    storage: Storage
    settings: Settings
    users: dict[str, tuple[int, dict[str, str]]]  # name -> (id, auth headers)

    def headers(self, user: str) -> dict[str, str]:
        return self.users[user][1]


@pytest.fixture(scope="module")
def s3_options() -> Iterator[dict[str, Any]]:
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


def _settings(request: pytest.FixtureRequest, home: Path) -> Settings:
    extra: dict[str, Any] = {"max_upload_bytes": UPLOAD_LIMIT, "max_code_members": MEMBERS_LIMIT}
    if request.param == "postgres-s3":
        extra["database_url"] = request.getfixturevalue("module_pg_url")
        extra["storage_url"] = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/checkpoints"
        extra["storage_options"] = request.getfixturevalue("s3_options")
    settings = Settings(home=home, admin_token=TOKEN, **extra)
    if request.param == "sqlite-file":
        upgrade(settings)
    return settings


@pytest.fixture(scope="module", params=["sqlite-file", "postgres-s3"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    settings = _settings(request, tmp_path_factory.mktemp(f"folders-{request.param}"))
    db = Database(settings)
    with TestClient(create_app(settings, scheduler=False)) as api:
        users = {}
        for name in ("alice", "bob"):
            made = api.post("/v1/users", json={"name": name}, headers={"Authorization": f"Bearer {TOKEN}"})
            assert made.status_code == 201, made.text
            users[name] = (made.json()["id"], {"Authorization": f"Bearer {made.json()['token']}"})
        yield Env(request.param, api, db, Storage.from_settings(settings), settings, users)
    db.engine.dispose()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_folder(
    env: Env, owner: str, name: str, files: dict[str, bytes], node_ranks: dict[str, int] | None = None
) -> dict[str, Any]:
    """A folder checkpoint as the taking side records one: each file its own stored object
    under the folder's prefix, a row per file, the manifest's SHA-256 as the checkpoint's."""
    prefix = f"jobs/test/{uuid.uuid4().hex}"
    rows = []
    for i, (path, data) in enumerate(files.items()):
        key = f"{prefix}/{i:05d}"
        env.storage.put_stream(iter([data]), key)
        rows.append((path, len(data), sha(data), (node_ranks or {}).get(path, 0), key))
    _, manifest_sha = manifest_of([(p, s, h) for p, s, h, _, _ in rows])
    with env.db.transaction() as session:
        ckpt = Checkpoint(
            owner_id=env.users[owner][0],
            job_id=None,
            name=name,
            size_bytes=sum(s for _, s, _, _, _ in rows),
            sha256=manifest_sha,
            storage_key=prefix,
            metrics={},
            kind="folder",
            files=len(rows),
        )
        session.add(ckpt)
        session.flush()
        for path, size, digest, node, key in rows:
            session.add(
                CheckpointFile(
                    checkpoint_id=ckpt.id,
                    path=path,
                    size_bytes=size,
                    sha256=digest,
                    node_rank=node,
                    storage_key=key,
                )
            )
        ckpt_id = ckpt.id
    got = env.api.get(f"/v1/checkpoints/{ckpt_id}", headers=env.headers(owner))
    assert got.status_code == 200, got.text
    return dict(got.json())


@pytest.fixture
def served(env: Env) -> Iterator[str]:
    """The same app behind a real HTTP server (uvicorn in a thread), for the real command."""
    port = harness.free_port()
    server = uvicorn.Server(
        uvicorn.Config(env.api.app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
