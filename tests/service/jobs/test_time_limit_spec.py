"""`max_duration_s` and `stall_timeout_s` (contract §8) at the API, and what a node's claim
hands its clocks: the time limit less what the job's earlier attempts ran."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.db import Database
from service.jobs.lifecycle import node_limits
from service.migrate import upgrade
from service.models import JobAttempt, utcnow
from tests.factories import make_job, make_user

TOKEN = "tj_limits_admin_token_0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "digits"}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    s = Settings(home=tmp_path, admin_token=TOKEN)
    upgrade(s)
    return s


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, scheduler=False)) as client:
        yield client


def post(api: TestClient, **fields: object) -> tuple[int, dict]:
    answer = api.post("/v1/jobs", json={"mode": "single", "entrypoint": ENTRY, **fields}, headers=ADMIN)
    return answer.status_code, answer.json()


def test_defaults_and_given_values_are_shown_back(api: TestClient) -> None:
    code, job = post(api)
    assert code == 201 and job["max_duration_s"] is None and job["stall_timeout_s"] == 600
    code, job = post(api, max_duration_s=3600, stall_timeout_s=None)
    assert code == 201 and job["max_duration_s"] == 3600 and job["stall_timeout_s"] is None
    assert api.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["max_duration_s"] == 3600


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_duration_s", 0),
        ("max_duration_s", -5),
        ("max_duration_s", "60"),
        ("max_duration_s", 1.5),
        ("max_duration_s", 10**9),
        ("stall_timeout_s", 0),
        ("stall_timeout_s", True),
        ("stall_timeout_s", 10**8),
    ],
)
def test_a_bad_limit_is_a_422_naming_its_field_and_creates_nothing(
    api: TestClient, field: str, value: object
) -> None:
    code, body = post(api, **{field: value})
    assert code == 422
    assert any(field in [str(p) for p in err["loc"]] for err in body["detail"]), body
    assert api.get("/v1/jobs", headers=ADMIN).json()["items"] == []


def test_the_time_left_counts_every_earlier_attempt(settings: Settings) -> None:
    db = Database(settings)
    now = utcnow()
    with db.transaction() as s:
        job = make_job(s, make_user(s).id, "running", entrypoint=ENTRY, attempt=3, max_duration_s=100)
        for attempt, seconds in ((1, 30), (2, 25.5)):
            s.add(
                JobAttempt(
                    job_id=job.id,
                    attempt=attempt,
                    started_at=now - timedelta(seconds=seconds),
                    finished_at=now,
                )
            )
        s.flush()
        limits = node_limits(s, job)
        assert limits.time_left_s == pytest.approx(44.5)
        assert limits.max_duration_s == 100 and limits.stall_timeout_s is None
        job.max_duration_s = 50
        assert node_limits(s, job).time_left_s == 0  # used up: the node stops at once
        job.max_duration_s, job.stall_timeout_s = None, 600
        assert node_limits(s, job).time_left_s is None and node_limits(s, job).stall_timeout_s == 600
    db.dispose()
