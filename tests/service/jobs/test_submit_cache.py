"""`POST /v1/jobs` keeps its callers and the cluster's capacity between requests (#42), on both
databases: whatever changes "elsewhere" (a second `Database`, with its own engine and
connections, as another API process, a worker or the CLI has; no change feed involved) is
answered by the very next submit exactly as if nothing were kept: a revoked token is a 401,
changed limits and hosts give the 4xx or the job that the tables give."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text, update

from service.app import create_app
from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from service.models import User
from service.users.service import rotate_token
from tests.factories import make_worker

TOKEN = "tj_submit_cache_admin_token_0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "digits"}


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    extra: dict[str, Any] = {"database_url": url} if url else {}
    s = Settings(home=tmp_path, admin_token=TOKEN, heartbeat_timeout_s=3600, **extra)
    upgrade(s)
    return s


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, scheduler=False)) as client:
        yield client


@pytest.fixture
def elsewhere(settings: Settings) -> Iterator[Database]:
    db = Database(settings)
    yield db
    db.dispose()


def add_user(api: TestClient, name: str, **limits: Any) -> tuple[int, dict[str, str]]:
    made = api.post("/v1/users", json={"name": name, **limits}, headers=ADMIN)
    assert made.status_code == 201, made.text
    return made.json()["id"], {"Authorization": f"Bearer {made.json()['token']}"}


def submit(api: TestClient, headers: dict[str, str], **fields: Any) -> Any:
    return api.post("/v1/jobs", json={"mode": "single", "entrypoint": ENTRY, **fields}, headers=headers)


def register(db: Database, name: str, gpus: int, accelerator: str = "cpu") -> None:
    """A host (re-)registering, as its agent does at every start."""
    with db.transaction() as session:
        make_worker(session, name, gpus=gpus, accelerator=accelerator, session_id=f"{name}-{gpus}")


def test_a_token_revoked_through_the_api_is_refused_at_the_next_submit(api: TestClient) -> None:
    user_id, alice = add_user(api, "alice")
    assert submit(api, alice).status_code == 201
    assert submit(api, alice).status_code == 201  # from the copy
    assert api.delete(f"/v1/users/{user_id}/tokens", headers=ADMIN).status_code == 204
    refused = submit(api, alice)
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"


def test_a_token_revoked_elsewhere_is_refused_at_the_next_submit(
    api: TestClient, elsewhere: Database
) -> None:
    user_id, alice = add_user(api, "alice")
    assert submit(api, alice).status_code == 201
    with elsewhere.transaction() as session:
        rotate_token(session, user_id, issue_new=False)
    assert submit(api, alice).status_code == 401
    assert submit(api, alice).status_code == 401  # and the copy is gone, not tried again and again


def test_a_revoked_token_with_a_bad_body_is_a_401_as_before(api: TestClient, elsewhere: Database) -> None:
    """FastAPI's own 422 (a body or header that does not parse) is decided before the handler:
    the caller's copy is checked then, so a revoked token stays the 401 that looking it up gave."""
    user_id, alice = add_user(api, "alice")
    assert submit(api, alice).status_code == 201
    assert submit(api, alice, gpus_per_node="two").status_code == 422  # a valid token: the 422
    long_key = {**alice, "Idempotency-Key": "k" * 300}
    with elsewhere.transaction() as session:
        rotate_token(session, user_id, issue_new=False)
    assert submit(api, alice, gpus_per_node="two").status_code == 401
    assert submit(api, long_key).status_code == 401


def test_limits_changed_elsewhere_decide_the_next_submit(api: TestClient, elsewhere: Database) -> None:
    user_id, alice = add_user(api, "alice", max_priority=5, gpu_quota=4)
    assert submit(api, alice, priority=5).status_code == 201
    with elsewhere.transaction() as session:
        session.execute(update(User).where(User.id == user_id).values(max_priority=2))
    lowered = submit(api, alice, priority=5)
    assert lowered.status_code == 422 and lowered.json()["detail"][0]["loc"] == ["body", "priority"]
    assert submit(api, alice, priority=2).status_code == 201
    with elsewhere.transaction() as session:  # raised: what the copy refused, the table allows
        session.execute(update(User).where(User.id == user_id).values(max_priority=7, gpu_quota=None))
    assert submit(api, alice, priority=7).status_code == 201
    with elsewhere.transaction() as session:
        session.execute(update(User).where(User.id == user_id).values(gpu_quota=0))
    quota = submit(api, alice)
    assert quota.status_code == 422 and quota.json()["detail"][0]["loc"] == ["body", "gpu_quota"]


def test_a_renamed_owner_is_shown_by_the_next_submit(api: TestClient, elsewhere: Database) -> None:
    user_id, alice = add_user(api, "alice")
    assert submit(api, alice).json()["owner"] == "alice"
    with elsewhere.transaction() as session:
        session.execute(update(User).where(User.id == user_id).values(name="alicia"))
    assert submit(api, alice).json()["owner"] == "alicia"


def test_hosts_changed_elsewhere_decide_the_next_submit(api: TestClient, elsewhere: Database) -> None:
    register(elsewhere, "w1", gpus=8)
    assert submit(api, ADMIN, gpus_per_node=8, mode="ddp").status_code == 201
    register(elsewhere, "w1", gpus=2)  # restarted with fewer GPUs
    shrunk = submit(api, ADMIN, gpus_per_node=8, mode="ddp")
    assert shrunk.status_code == 422
    assert shrunk.json()["detail"][0]["msg"] == "asks for 8 GPUs per node; the largest worker has 2"
    register(elsewhere, "w2", gpus=8)  # a new host: what the copy refused, the hosts allow
    assert submit(api, ADMIN, gpus_per_node=8, mode="ddp").status_code == 201
    assert submit(api, ADMIN, nodes=2, gpus_per_node=8, mode="ddp").status_code == 422
    register(elsewhere, "w3", gpus=8)
    assert submit(api, ADMIN, nodes=2, gpus_per_node=8, mode="ddp").status_code == 201


def test_an_accelerator_changed_elsewhere_decides_the_next_fp16_submit(
    api: TestClient, elsewhere: Database
) -> None:
    fp16 = {"hyperparameters": {"amp": "fp16"}}
    register(elsewhere, "w1", gpus=1, accelerator="cuda")
    assert submit(api, ADMIN, **fp16).status_code == 201
    register(elsewhere, "w1", gpus=1, accelerator="cpu")
    assert submit(api, ADMIN, **fp16).status_code == 422


def test_a_heartbeat_or_an_unchanged_restart_keeps_the_copy(api: TestClient, elsewhere: Database) -> None:
    """Only what a job is checked against moves the hosts' version: a host restarting with the
    same GPUs does not make every process read the hosts again."""
    register(elsewhere, "w1", gpus=4)
    assert submit(api, ADMIN).status_code == 201
    kept = api.app.state.submit_cache.cluster  # type: ignore[attr-defined]
    register(elsewhere, "w1", gpus=4)
    assert submit(api, ADMIN).status_code == 201
    assert api.app.state.submit_cache.cluster is kept  # type: ignore[attr-defined]


def test_a_job_written_in_one_statement_leaves_its_unset_json_columns_sql_null(
    api: TestClient, elsewhere: Database
) -> None:
    """As the unit of work left them (JSON's own bind would write the text `null`)."""
    register(elsewhere, "w1", 2)
    for _ in range(2):  # the second from the copies: the one-statement write
        assert submit(api, ADMIN).status_code == 201
    with elsewhere.read() as session:
        rows = session.execute(text("SELECT count(*) FROM jobs WHERE sweep IS NULL AND objective IS NULL"))
        assert rows.scalar_one() == 2
