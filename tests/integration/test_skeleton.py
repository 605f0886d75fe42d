"""Issue 2: jobs go from POST to a finished torchrun on both setups, through real processes.

`embedded` is the real `torchjobs up` (SQLite, filesystem broker, local worker); `production`
is `torchjobs db upgrade` + `server` + `worker` on PostgreSQL and Redis.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from service.testing.harness import Stack

BUILTIN = {"kind": "builtin", "model": "cnn", "dataset": "digits"}
HYPER = {"epochs": 2, "batch_size": 64, "report_every": 5}  # num_workers: the default, 2


@pytest.fixture(params=["embedded", "production"])
def stack(request: pytest.FixtureRequest) -> Stack:
    return request.getfixturevalue(request.param)


def states_of(events: list[dict]) -> list[str]:
    return [e["data"]["state"] for e in events if e["type"] == "state"]


@pytest.mark.parametrize(("mode", "gpus"), [("single", 1), ("ddp", 2)])
def test_builtin_job_runs_to_success(stack: Stack, mode: str, gpus: int, tmp_path) -> None:
    job = stack.submit(
        {
            "name": f"digits-{mode}",
            "mode": mode,
            "gpus_per_node": gpus,
            "entrypoint": BUILTIN,
            "hyperparameters": HYPER,
        }
    )
    assert job["state"] == "queued" and job["attempt"] == 1 and job["owner"] == "admin"
    done = stack.wait_job(job["id"])
    assert done["state"] == "succeeded", done["error"]
    assert done["exit_code"] == 0
    assert done["progress"]["epoch"] == 2 and done["progress"]["fraction"] == 1.0
    assert len(done["assignments"]) == 1 and len(done["assignments"][0]["gpus"]) == gpus
    assert [a["attempt"] for a in done["attempts"]] == [1]

    events = stack.events(job["id"])
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert states_of(events) == ["queued", "scheduled", "running", "succeeded"]
    epochs_reported = {e["data"]["epoch"] for e in events if e["type"] == "progress"}
    assert {1, 2} <= epochs_reported  # at least one progress event per epoch
    fractions = [e["data"]["fraction"] for e in events if e["type"] == "progress"]
    assert fractions == sorted(fractions) and fractions[0] > 0 and fractions[-1] == 1.0  # §2's fields
    checkpoints = [e["data"] for e in events if e["type"] == "checkpoint"]
    assert [c["epoch"] for c in checkpoints] == [1, 2]
    assert checkpoints[-1]["step"] == done["progress"]["step"]  # told by the trainer, not guessed
    assert checkpoints[-1]["metrics"]["val_accuracy"] is not None

    latest = done["latest_checkpoint"]
    with stack.client() as c:
        resp = c.get(latest["download_url"])
    assert resp.status_code == 200
    assert hashlib.sha256(resp.content).hexdigest() == latest["sha256"]
    path = tmp_path / "ckpt.pt"
    path.write_bytes(resp.content)
    state = torch.load(path, weights_only=True)
    assert {"state_dict", "optimizer", "epoch", "step", "meta"} <= set(state)
    assert state["epoch"] == 2
    assert not any(k.startswith("module.") for k in state["state_dict"]["net"])
    assert state["meta"]["mode"] == mode


def test_failing_script_reports_exit_code_and_stderr(stack: Stack) -> None:
    job = stack.submit({"mode": "single", "entrypoint": {"kind": "script", "path": "fail.py"}})
    done = stack.wait_job(job["id"])
    assert done["state"] == "failed"
    assert done["exit_code"] == 3
    assert "the answer was not 42" in done["error"]
    assert states_of(stack.events(job["id"]))[-1] == "failed"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"mode": "single", "entrypoint": BUILTIN, "unknown_field": 1}, "unknown_field"),
        ({"mode": "single", "gpus_per_node": 2, "entrypoint": BUILTIN}, "gpus_per_node"),
        ({"mode": "dp", "nodes": 2, "entrypoint": BUILTIN}, "nodes"),
        ({"mode": "single", "entrypoint": BUILTIN, "hyperparameters": {"epochs": 0}}, "epochs"),
        ({"mode": "ddp", "gpus_per_node": 64, "entrypoint": BUILTIN}, "gpus_per_node"),
        ({"mode": "single", "entrypoint": {"kind": "script", "path": "../../etc/passwd"}}, "path"),
    ],
)
def test_invalid_spec_is_422_naming_the_field_and_writes_nothing(
    stack: Stack, spec: dict, field: str
) -> None:
    with stack.client() as c:
        before = c.get("/v1/jobs", params={"limit": 500}).json()["items"]
        resp = c.post("/v1/jobs", json=spec)
        after = c.get("/v1/jobs", params={"limit": 500}).json()["items"]
    assert resp.status_code == 422
    assert any(field in [str(p) for p in err["loc"]] for err in resp.json()["detail"]), resp.json()
    assert [j["id"] for j in after] == [j["id"] for j in before]


def test_every_endpoint_needs_a_token(stack: Stack) -> None:
    import httpx

    assert httpx.get(f"{stack.url}/healthz").json() == {"status": "ok"}
    for path in ("/v1/jobs", "/v1/jobs/1", "/v1/jobs/1/events", "/v1/workers", "/v1/me"):
        assert httpx.get(f"{stack.url}{path}").status_code == 401
        assert httpx.get(f"{stack.url}{path}", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_resumed_job_starts_at_the_saved_epoch(embedded: Stack) -> None:
    first = embedded.submit({"mode": "single", "entrypoint": BUILTIN, "hyperparameters": HYPER})
    assert embedded.wait_job(first["id"])["state"] == "succeeded"
    spec = {
        "mode": "ddp",
        "gpus_per_node": 2,
        "entrypoint": BUILTIN,
        "hyperparameters": {**HYPER, "epochs": 3},
        "resume_from": {"job_id": first["id"]},
    }
    resumed = embedded.submit(spec)
    assert resumed["progress"]["epoch"] == 2  # contract §2: counts what is completed, from the start
    done = embedded.wait_job(resumed["id"])
    assert done["state"] == "succeeded", done["error"]
    progress = [e["data"] for e in embedded.events(resumed["id"]) if e["type"] == "progress"]
    assert progress[0]["epoch"] == 2 and progress[-1]["epoch"] == 3
    assert [
        c["epoch"] for c in [e["data"] for e in embedded.events(resumed["id"]) if e["type"] == "checkpoint"]
    ] == [3]


def test_an_ordinary_torchrun_script_runs_unchanged(embedded: Stack) -> None:
    job = embedded.submit(
        {"mode": "ddp", "gpus_per_node": 2, "entrypoint": {"kind": "script", "path": "plain_ddp.py"}}
    )
    done = embedded.wait_job(job["id"])
    assert done["state"] == "succeeded", done["error"]
    events = embedded.events(job["id"])
    assert [e["data"]["name"] for e in events if e["type"] == "checkpoint"] == ["plain-1.pt", "plain-2.pt"]
    assert [e["data"]["epoch"] for e in events if e["type"] == "progress"] == [1, 2]
    with embedded.client() as c:
        rank1 = c.get(f"/v1/jobs/{job['id']}/logs", params={"node": 0, "rank": 1}).text
    assert "rank 1 local 1 epoch 1" in rank1


def test_a_checkpoint_saved_again_under_its_name_is_a_new_checkpoint(embedded: Stack, tmp_path) -> None:
    """Contract §4: every complete file that appears becomes a Checkpoint, in the order
    written, including `last.pt` saved over itself; each keeps its own bytes."""
    script = {"kind": "script", "path": "rewrite_checkpoint.py"}
    job = embedded.submit({"mode": "single", "entrypoint": script})
    assert embedded.wait_job(job["id"])["state"] == "succeeded"
    with embedded.client() as c:
        items = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
        assert [i["name"] for i in items] == ["last.pt", "last.pt"]
        saved = []
        for item in items:
            body = c.get(f"/v1/checkpoints/{item['id']}/download").content
            assert hashlib.sha256(body).hexdigest() == item["sha256"]
            (tmp_path / "ckpt.pt").write_bytes(body)
            saved.append(torch.load(tmp_path / "ckpt.pt", weights_only=True)["epoch"])
    assert saved == [1, 2]
