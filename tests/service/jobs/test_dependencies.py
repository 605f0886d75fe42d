"""`depends_on` (contract §10) at the API and in the scheduler's pass, on SQLite: what a
submit refuses, how a waiting job says what it waits for, when it runs, when it fails (a
cancel fails the chain in its own transaction), and a dependency's final checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.db import Database
from service.models import Checkpoint, Job
from tests.service.jobs.on_sqlite import api_client, move, schedule, settings_with_worker

TOKEN = "tj_deps_admin_token_0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "digits"}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return settings_with_worker(tmp_path, TOKEN, gpus=1)


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with api_client(settings) as client:
        yield client


def submit(api: TestClient, headers: dict[str, str] = ADMIN, **fields: object) -> tuple[int, dict]:
    answer = api.post("/v1/jobs", json={"mode": "single", "entrypoint": ENTRY, **fields}, headers=headers)
    return answer.status_code, answer.json()


def job(api: TestClient, job_id: int) -> dict:
    return api.get(f"/v1/jobs/{job_id}", headers=ADMIN).json()


def test_a_submit_names_existing_jobs_of_its_owner_that_can_still_meet_the_condition(api: TestClient) -> None:
    code, a = submit(api)
    assert code == 201
    alice = api.post("/v1/users", json={"name": "alice"}, headers=ADMIN).json()["token"]
    as_alice = {"Authorization": f"Bearer {alice}"}
    cases = [
        (
            {"depends_on": [{"job_id": a["id"] + 1}]},
            ADMIN,
            ["body", "depends_on", 0, "job_id"],
        ),  # not yet there
        ({"depends_on": [{"job_id": a["id"]}]}, as_alice, ["body", "depends_on", 0, "job_id"]),  # not hers
        ({"depends_on": [{"job_id": a["id"]}, {"job_id": a["id"], "condition": "ended"}]}, ADMIN, None),
        ({"depends_on": [{"job_id": a["id"], "condition": "started"}]}, ADMIN, None),
        ({"depends_on": [{"job_id": "1"}]}, ADMIN, None),
    ]
    for fields, headers, loc in cases:
        code, body = submit(api, headers, **fields)
        assert code == 422, (fields, body)
        if loc is not None:
            assert body["detail"][0]["loc"] == loc, body
    assert len(api.get("/v1/jobs", headers=ADMIN).json()["items"]) == 1  # nothing was created
    code, b = submit(api, depends_on=[{"job_id": a["id"]}])
    assert code == 201 and b["depends_on"] == [{"job_id": a["id"], "condition": "succeeded"}]


def test_a_waiting_job_says_what_for_and_runs_once_the_condition_holds(
    api: TestClient, settings: Settings
) -> None:
    _, a = submit(api)
    _, b = submit(api, depends_on=[{"job_id": a["id"]}])
    _, c = submit(api, depends_on=[{"job_id": a["id"], "condition": "ended"}])
    schedule(settings)
    schedule(settings)  # the reason is as of the pass's start: a was still queued in the first
    assert job(api, a["id"])["state"] == "scheduled"
    assert job(api, b["id"])["pending_reason"] == f"waits for job {a['id']} to succeed (it is scheduled)"
    assert job(api, c["id"])["pending_reason"] == f"waits for job {a['id']} to end (it is scheduled)"
    move(settings, a["id"], "running", "succeeded")
    schedule(settings)
    assert job(api, b["id"])["state"] == "scheduled"  # the one slot: b, the older
    assert job(api, c["id"])["state"] == "queued" and "1 free GPUs" in job(api, c["id"])["pending_reason"]


def test_a_failed_dependency_fails_the_chain_and_ended_still_runs(
    api: TestClient, settings: Settings
) -> None:
    _, a = submit(api)
    _, b = submit(api, depends_on=[{"job_id": a["id"]}])
    _, c = submit(api, depends_on=[{"job_id": b["id"]}])
    _, d = submit(api, depends_on=[{"job_id": a["id"], "condition": "ended"}])
    schedule(settings)
    move(settings, a["id"], "running", "failed")
    schedule(settings)
    for dependant, on in ((b, a), (c, b)):
        got = job(api, dependant["id"])
        assert got["state"] == "failed", got
        assert got["error"] == f"dependency job {on['id']} failed: the condition 'succeeded' can never hold"
    assert job(api, d["id"])["state"] == "scheduled"


def test_cancelling_a_job_fails_its_dependants_in_the_same_transaction(api: TestClient) -> None:
    _, a = submit(api)
    _, b = submit(api, depends_on=[{"job_id": a["id"]}])
    _, c = submit(api, depends_on=[{"job_id": b["id"]}])
    assert api.post(f"/v1/jobs/{a['id']}/cancel", headers=ADMIN).status_code == 202
    assert job(api, b["id"])["state"] == "failed"  # no scheduler pass ran in between
    assert "was cancelled" in job(api, b["id"])["error"]
    assert job(api, c["id"])["state"] == "failed"
    code, late = submit(api, depends_on=[{"job_id": a["id"]}])  # a already ended: taken, failed at once
    assert (code, late["state"]) == (201, "failed"), late
    assert late["error"] == f"dependency job {a['id']} cancelled: the condition 'succeeded' can never hold"
    ended = submit(api, depends_on=[{"job_id": a["id"], "condition": "ended"}])[1]
    assert ended["state"] == "queued"  # "ended" holds: it runs


def test_resuming_from_a_dependency_takes_its_final_checkpoint_at_placement(
    api: TestClient, settings: Settings
) -> None:
    _, a = submit(api)
    code, b = submit(api, depends_on=[{"job_id": a["id"]}], resume_from={"job_id": a["id"]})
    assert code == 201, b  # a has no checkpoint yet: that is fine, it is taken later
    _, c = submit(
        api, depends_on=[{"job_id": a["id"], "condition": "ended"}], resume_from={"job_id": a["id"]}
    )
    schedule(settings)
    db = Database(settings)
    with db.transaction() as s:
        owner = s.get(Job, a["id"]).owner_id  # type: ignore[union-attr]
        for epoch in (1, 2):
            s.add(
                Checkpoint(
                    owner_id=owner,
                    job_id=a["id"],
                    attempt=1,
                    name=f"epoch-{epoch:04d}.pt",
                    epoch=epoch,
                    step=epoch * 10,
                    size_bytes=1,
                    sha256="0" * 64,
                    storage_key=f"jobs/{a['id']}/e{epoch}",
                )
            )
    move(settings, a["id"], "running", "succeeded")
    schedule(settings)
    with db.transaction() as s:
        placed = s.get(Job, b["id"])
        final = s.query(Checkpoint).filter_by(job_id=a["id"], epoch=2).one()
        assert placed is not None and placed.state == "scheduled" and placed.resume_checkpoint_id == final.id
    db.dispose()
    assert job(api, c["id"])["state"] == "queued"


def test_a_dependency_that_left_no_checkpoint_fails_the_resuming_job(
    api: TestClient, settings: Settings
) -> None:
    _, a = submit(api)
    _, b = submit(
        api, depends_on=[{"job_id": a["id"], "condition": "ended"}], resume_from={"job_id": a["id"]}
    )
    schedule(settings)
    move(settings, a["id"], "running", "failed")
    schedule(settings)
    got = job(api, b["id"])
    assert (
        got["state"] == "failed"
        and got["error"] == f"dependency job {a['id']} left no checkpoint to resume from"
    )
