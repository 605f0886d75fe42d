"""Sweeps (contract §10) at the API and in the scheduler's pass, on SQLite: what one request
creates or refuses whole, `max_parallel` in placement, the parent following its children,
and a cancel of the parent reaching every child."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from tests.service.jobs.on_sqlite import api_client, move, schedule, settings_with_worker

TOKEN = "tj_sweep_admin_token_0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "digits"}
GRID = {"hyperparameters.lr": [0.1, 0.01], "hyperparameters.seed": [0, 1]}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return settings_with_worker(tmp_path, TOKEN, gpus=4)


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with api_client(settings) as client:
        yield client


def submit(api: TestClient, headers: dict[str, str] = ADMIN, **fields: object) -> tuple[int, dict]:
    body = {"mode": "single", "entrypoint": ENTRY, "hyperparameters": {"epochs": 3}, **fields}
    answer = api.post("/v1/jobs", json=body, headers=headers)
    return answer.status_code, answer.json()


def job(api: TestClient, job_id: int) -> dict:
    return api.get(f"/v1/jobs/{job_id}", headers=ADMIN).json()


def children(api: TestClient, parent: int) -> list[dict]:
    answer = api.get(f"/v1/jobs?parent={parent}&limit=500", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    return sorted(answer.json()["items"], key=lambda j: j["id"])


def all_jobs(api: TestClient) -> list[dict]:
    return api.get("/v1/jobs?limit=500", headers=ADMIN).json()["items"]


def test_a_grid_makes_one_parent_and_a_child_per_point(api: TestClient) -> None:
    code, parent = submit(api, name="lrs", sweep={"grid": GRID, "max_parallel": 2})
    assert code == 201, parent
    assert parent["kind"] == "sweep" and parent["state"] == "running"
    assert parent["sweep"]["children"] == 4 and parent["sweep"]["max_parallel"] == 2
    assert parent["progress"]["fraction"] == 0.0
    kids = children(api, parent["id"])
    assert len(kids) == 4
    points = [k["sweep_point"] for k in kids]
    assert points == [
        {"hyperparameters.lr": 0.1, "hyperparameters.seed": 0},
        {"hyperparameters.lr": 0.1, "hyperparameters.seed": 1},
        {"hyperparameters.lr": 0.01, "hyperparameters.seed": 0},
        {"hyperparameters.lr": 0.01, "hyperparameters.seed": 1},
    ]
    for kid, point in zip(kids, points, strict=True):
        assert kid["kind"] == "job" and kid["parent_id"] == parent["id"] and kid["state"] == "queued"
        assert kid["hyperparameters"]["lr"] == point["hyperparameters.lr"]
        assert kid["hyperparameters"]["seed"] == point["hyperparameters.seed"]
        assert kid["hyperparameters"]["epochs"] == 3  # the rest of the spec as submitted
        assert kid["name"] == "lrs"
    events = api.get(f"/v1/jobs/{parent['id']}/events", headers=ADMIN).json()["items"]
    assert [e["data"]["state"] for e in events if e["type"] == "state"] == ["queued", "running"]


def test_a_bad_point_is_a_422_naming_it_and_nothing_is_created(api: TestClient) -> None:
    at = ["body", "sweep", "grid"]
    cases = [
        ({"grid": {"hyperparameters.lr": [0.1, 20.0]}}, [*at, "hyperparameters.lr"], "20"),
        ({"grid": {"gpus_per_node": [1, 2]}}, [*at, "gpus_per_node"], "single"),
        ({"grid": {"hyperparameters.colour": ["red"]}}, [*at, "hyperparameters.colour"], ""),
        ({"grid": {"mode.inner": [1]}}, [*at, "mode.inner"], "not an object"),
        ({"grid": {"nodes": [1, 99]}}, [*at, "nodes"], ""),
        ({"grid": {"hyperparameters.lr": []}}, None, ""),
        ({"grid": {}}, None, ""),
        ({"grid": {"sweep.max_parallel": [1]}}, None, "its own sweep"),
        ({"grid": {"hyperparameters": [{}], "hyperparameters.lr": [0.1]}}, None, "overlap"),
        ({"grid": {"hyperparameters.seed": list(range(1001))}}, None, ""),
        ({"grid": {"hyperparameters.seed": list(range(40)), "hyperparameters.lr": [0.1] * 26}}, None, "1040"),
        ({"grid": {"hyperparameters.lr": [0.1]}, "max_parallel": 0}, None, ""),
        ({"grid": {"Bad Path": [1]}}, None, ""),
        ({"grid": {"hyperparameters.lr": [0.1]}, "extra": 1}, None, ""),
    ]
    for sweep, loc, words in cases:
        code, body = submit(api, sweep=sweep)
        assert code == 422, (sweep, body)
        if loc is not None:
            assert body["detail"][0]["loc"] == loc, (sweep, body)
        assert words in str(body["detail"]), (sweep, body)
    assert all_jobs(api) == []


def test_the_context_of_each_point_is_checked_too(api: TestClient) -> None:
    """A point that parses but could never run (more GPUs than any worker) names its point."""
    code, body = submit(api, mode="ddp", sweep={"grid": {"gpus_per_node": [2, 8]}})
    assert code == 422
    assert body["detail"][0]["loc"] == ["body", "gpus_per_node"]
    assert "sweep point 1" in body["detail"][0]["msg"]
    assert all_jobs(api) == []


def test_max_parallel_holds_in_placement_and_the_parent_follows(api: TestClient, settings: Settings) -> None:
    _, parent = submit(api, sweep={"grid": GRID, "max_parallel": 2})
    schedule(settings)
    kids = children(api, parent["id"])
    assert [k["state"] for k in kids] == ["scheduled", "scheduled", "queued", "queued"]
    assert "max_parallel" in kids[2]["pending_reason"]
    for kid in kids[:2]:
        move(settings, kid["id"], "running", "succeeded")
    schedule(settings)  # two free slots of the sweep: the next two
    kids = children(api, parent["id"])
    assert [k["state"] for k in kids] == ["succeeded", "succeeded", "scheduled", "scheduled"]
    view = job(api, parent["id"])
    assert view["state"] == "running" and view["progress"]["fraction"] == 0.5
    assert view["sweep"]["states"] == {"succeeded": 2, "scheduled": 2}
    for kid in kids[2:]:
        move(settings, kid["id"], "running", "succeeded")
    schedule(settings)
    view = job(api, parent["id"])
    assert view["state"] == "succeeded" and view["progress"]["fraction"] == 1.0
    progress = [
        e["data"]["fraction"]
        for e in api.get(f"/v1/jobs/{parent['id']}/events", headers=ADMIN).json()["items"]
        if e["type"] == "progress"
    ]
    assert progress == sorted(progress) and progress[-1] == 1.0


def test_one_failed_child_fails_the_parent_once_the_others_end(api: TestClient, settings: Settings) -> None:
    _, parent = submit(api, sweep={"grid": {"hyperparameters.lr": [0.1, 0.01, 0.001]}})
    schedule(settings)  # no max_parallel: all three placed at once
    kids = children(api, parent["id"])
    assert [k["state"] for k in kids] == ["scheduled"] * 3
    move(settings, kids[0]["id"], "running", "failed")
    schedule(settings)
    assert job(api, parent["id"])["state"] == "running"  # the others still run
    assert [k["state"] for k in children(api, parent["id"])][1:] == ["scheduled", "scheduled"]
    for kid in kids[1:]:
        move(settings, kid["id"], "running", "succeeded")
    schedule(settings)
    view = job(api, parent["id"])
    assert view["state"] == "failed"
    assert f"jobs {kids[0]['id']} failed" in view["error"]


def test_cancelling_the_parent_cancels_every_child(api: TestClient, settings: Settings) -> None:
    _, parent = submit(api, sweep={"grid": GRID, "max_parallel": 1})
    schedule(settings)
    answer = api.post(f"/v1/jobs/{parent['id']}/cancel", headers=ADMIN)
    assert answer.status_code == 202 and answer.json()["state"] == "cancelling"
    kids = children(api, parent["id"])
    assert [k["state"] for k in kids] == ["cancelling", "cancelled", "cancelled", "cancelled"]
    move(settings, kids[0]["id"], "cancelled")  # its node confirmed the stop
    schedule(settings)
    assert job(api, parent["id"])["state"] == "cancelled"
    again = api.post(f"/v1/jobs/{parent['id']}/cancel", headers=ADMIN)  # as for any job: no-op
    assert again.status_code == 202 and again.json()["state"] == "cancelled"


def test_a_queued_sweep_is_cancelled_at_once(api: TestClient) -> None:
    _, parent = submit(api, sweep={"grid": GRID})
    answer = api.post(f"/v1/jobs/{parent['id']}/cancel", headers=ADMIN)
    assert answer.json()["state"] == "cancelled"
    assert {k["state"] for k in children(api, parent["id"])} == {"cancelled"}


def test_the_idempotency_key_returns_the_first_sweep(api: TestClient) -> None:
    headers = {**ADMIN, "Idempotency-Key": "sweep-1"}
    body = {"mode": "single", "entrypoint": ENTRY, "sweep": {"grid": GRID}}
    first = api.post("/v1/jobs", json=body, headers=headers)
    again = api.post("/v1/jobs", json=body, headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert len(all_jobs(api)) == 5


def test_children_of_another_users_sweep_are_not_listed(api: TestClient) -> None:
    _, parent = submit(api, sweep={"grid": GRID})
    bob = api.post("/v1/users", json={"name": "bob"}, headers=ADMIN).json()["token"]
    answer = api.get(f"/v1/jobs?parent={parent['id']}", headers={"Authorization": f"Bearer {bob}"})
    assert answer.status_code == 404
    assert api.get("/v1/jobs?parent=0", headers=ADMIN).status_code == 422
    assert api.get("/v1/jobs?parent=99999", headers=ADMIN).status_code == 404


def test_a_sweep_may_wait_for_a_job_and_a_job_for_a_sweep(api: TestClient, settings: Settings) -> None:
    _, first = submit(api)
    grid = {"hyperparameters.lr": [0.1, 0.01]}
    _, parent = submit(api, sweep={"grid": grid}, depends_on=[{"job_id": first["id"]}])
    _, after = submit(api, depends_on=[{"job_id": parent["id"]}])
    schedule(settings)
    kids = children(api, parent["id"])
    assert all(f"job {first['id']}" in k["pending_reason"] for k in kids)
    assert f"job {parent['id']}" in job(api, after["id"])["pending_reason"]
    move(settings, first["id"], "running", "failed")
    schedule(settings)  # the children fail, the sweep fails, and the job after it
    schedule(settings)
    assert {k["state"] for k in children(api, parent["id"])} == {"failed"}
    assert job(api, parent["id"])["state"] == "failed"
    assert job(api, after["id"])["state"] == "failed"


def test_a_grid_value_nested_past_the_limit_is_a_422_not_a_crash(api: TestClient) -> None:
    deep: object = "x"
    for _ in range(700):  # the JSON parser takes it; a recursive check would not
        deep = [deep]
    code, body = submit(api, sweep={"grid": {"name": [deep]}})
    assert code == 422 and "nest" in str(body["detail"]), body
    assert all_jobs(api) == []
