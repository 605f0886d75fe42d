"""Contract §9 at the API: users' max_priority and gpu_quota (set, changed, enforced at
submit), and GPU-seconds per user over a range (`GET /v1/usage`), a user seeing their own."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from service.models import Job, JobAttempt, User
from tests.factories import make_job, make_worker

TOKEN = "tj_fair_admin_token_0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "digits"}
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    s = Settings(home=tmp_path, admin_token=TOKEN)
    upgrade(s)
    with Database(s).transaction() as session:
        make_worker(session, "w1", gpus=4)
    return s


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, scheduler=False)) as client:
        yield client


def add_user(api: TestClient, name: str, **limits: object) -> tuple[int, dict[str, str]]:
    made = api.post("/v1/users", json={"name": name, **limits}, headers=ADMIN)
    assert made.status_code == 201, made.text
    return made.json()["id"], {"Authorization": f"Bearer {made.json()['token']}"}


def submit(api: TestClient, headers: dict[str, str], **fields: object) -> tuple[int, dict]:
    answer = api.post("/v1/jobs", json={"mode": "ddp", "entrypoint": ENTRY, **fields}, headers=headers)
    return answer.status_code, answer.json()


def test_limits_are_set_shown_changed_and_enforced_at_submit(api: TestClient) -> None:
    alice_id, alice = add_user(api, "alice", gpu_quota=2, max_priority=5)
    [row] = [u for u in api.get("/v1/users", headers=ADMIN).json()["items"] if u["name"] == "alice"]
    assert (row["gpu_quota"], row["max_priority"], row["gpus_in_use"]) == (2, 5, 0)
    assert api.get("/v1/me", headers=alice).json()["gpu_quota"] == 2

    assert submit(api, alice, priority=5, gpus_per_node=2)[0] == 201
    code, body = submit(api, alice, priority=6)
    assert code == 422 and body["detail"][0]["loc"] == ["body", "priority"], body
    code, body = submit(api, alice, gpus_per_node=3)
    assert code == 422 and body["detail"][0]["loc"] == ["body", "gpu_quota"], body
    assert "gpu_quota is 2" in body["detail"][0]["msg"]
    assert submit(api, ADMIN, priority=1000, gpus_per_node=4)[0] == 201  # the admin: no ceiling

    patched = api.patch(f"/v1/users/{alice_id}", json={"gpu_quota": None}, headers=ADMIN)
    assert patched.status_code == 200 and patched.json()["gpu_quota"] is None
    assert patched.json()["max_priority"] == 5  # untouched: not in the request
    assert submit(api, alice, gpus_per_node=3)[0] == 201


@pytest.mark.parametrize(
    "body",
    [
        {"gpu_quota": -1},
        {"gpu_quota": "2"},
        {"max_priority": 1001},
        {"max_priority": 1.5},
        {"colour": "red"},
    ],
)
def test_a_bad_limit_is_a_422_and_changes_nothing(api: TestClient, body: dict) -> None:
    alice_id, _ = add_user(api, "alice", gpu_quota=2)
    assert api.post("/v1/users", json={"name": "bob", **body}, headers=ADMIN).status_code == 422
    assert api.patch(f"/v1/users/{alice_id}", json=body, headers=ADMIN).status_code == 422
    names = [u["name"] for u in api.get("/v1/users", headers=ADMIN).json()["items"]]
    assert "bob" not in names
    assert api.get("/v1/users", headers=ADMIN).json()["items"][-1]["gpu_quota"] == 2


def test_only_the_admin_manages_users(api: TestClient) -> None:
    alice_id, alice = add_user(api, "alice")
    assert api.get("/v1/users", headers=alice).status_code == 403
    assert api.patch(f"/v1/users/{alice_id}", json={"gpu_quota": 99}, headers=alice).status_code == 403
    assert api.patch("/v1/users/999", json={"gpu_quota": 1}, headers=ADMIN).status_code == 404


def seed_attempts(settings: Settings, owner: str, spans: list[tuple[int, int, int | None]]) -> None:
    """(GPUs, start minute, end minute or None: still running) per attempt, one job each."""
    db = Database(settings)
    with db.transaction() as s:
        user = s.query(User).filter_by(name=owner).one()
        for gpus, start, end in spans:
            job: Job = make_job(
                s, user.id, "running", entrypoint=ENTRY, gpus_per_node=gpus, attempt_row=False
            )
            started = T0 + timedelta(minutes=start)
            finished = T0 + timedelta(minutes=end) if end is not None else None
            seconds = (finished - started).total_seconds() * gpus if finished else 0.0
            s.add(
                JobAttempt(
                    job_id=job.id,
                    attempt=1,
                    gpus=gpus,
                    started_at=started,
                    finished_at=finished,
                    gpu_seconds=seconds,
                )
            )
    db.dispose()


def test_usage_counts_each_attempt_inside_the_range(api: TestClient, settings: Settings) -> None:
    _, alice = add_user(api, "alice")
    add_user(api, "bob")
    seed_attempts(settings, "alice", [(2, 0, 10), (1, 5, 65)])  # 1200 + 3600 GPU-seconds
    seed_attempts(settings, "bob", [(4, 30, 31)])  # 240
    everyone = api.get("/v1/usage", headers=ADMIN).json()["items"]
    by_user = {r["user"]: r for r in everyone}
    expected = {"user": "alice", "gpu_seconds": 4800.0, "jobs": 2, "attempts": 2, "checkpoint_bytes": 0}
    assert by_user["alice"] == expected
    assert by_user["bob"]["gpu_seconds"] == 240.0 and by_user["admin"]["gpu_seconds"] == 0.0
    window = {
        "since": (T0 + timedelta(minutes=5)).isoformat(),
        "until": (T0 + timedelta(minutes=35)).isoformat(),
    }
    clipped = {r["user"]: r for r in api.get("/v1/usage", params=window, headers=ADMIN).json()["items"]}
    assert clipped["alice"]["gpu_seconds"] == 2 * 300 + 1 * 1800  # both attempts, cut to the window
    assert clipped["bob"]["gpu_seconds"] == 240.0
    naive = {"since": "2026-12-01T12:05:00", "until": "2026-12-01T12:35:00"}  # no zone: UTC
    naive_items = api.get("/v1/usage", params=naive, headers=ADMIN).json()["items"]
    assert {r["user"]: r["gpu_seconds"] for r in naive_items} == {
        u: r["gpu_seconds"] for u, r in clipped.items()
    }

    own = api.get("/v1/usage", headers=alice).json()["items"]
    assert [r["user"] for r in own] == ["alice"]
    assert api.get("/v1/usage", params={"user": "alice"}, headers=alice).status_code == 200
    assert api.get("/v1/usage", params={"user": "bob"}, headers=alice).status_code == 403
    assert api.get("/v1/usage", params={"user": "nobody"}, headers=ADMIN).status_code == 404
    bad = api.get("/v1/usage", params={"since": window["until"], "until": window["since"]}, headers=ADMIN)
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "until"]
    assert api.get("/v1/usage", params={"since": "yesterday"}, headers=ADMIN).status_code == 422


def test_a_job_shows_its_gpu_seconds_and_the_totals_equal_the_sum_over_jobs(
    api: TestClient, settings: Settings
) -> None:
    add_user(api, "alice")
    seed_attempts(settings, "alice", [(2, 0, 10), (1, 5, 65), (3, 0, 1)])
    jobs = api.get("/v1/jobs", headers=ADMIN).json()["items"]
    assert sorted(j["gpu_seconds"] for j in jobs) == [180.0, 1200.0, 3600.0]
    total = {r["user"]: r for r in api.get("/v1/usage", headers=ADMIN).json()["items"]}["alice"][
        "gpu_seconds"
    ]
    assert total == sum(j["gpu_seconds"] for j in jobs)
