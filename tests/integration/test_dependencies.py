"""Contract §10, a pipeline on real torchrun: B waits for A, then continues from A's weights;
A failing fails B naming A; a job cannot name one that does not exist yet (so no cycle)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from service.testing import harness
from service.testing.harness import Stack, script_job

MLP = {"kind": "builtin", "model": "mlp", "dataset": "synthetic"}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = harness.embedded_stack(tmp_path, warm=False)
    yield s
    s.stop()


def train(epochs: int, **extra: object) -> dict:
    hyper = {"epochs": epochs, "synthetic_size": 2048, "num_workers": 0, "seed": 5}
    return {"mode": "single", "entrypoint": MLP, "hyperparameters": hyper, **extra}


def test_b_starts_after_a_and_continues_from_its_weights(stack: Stack) -> None:
    a = stack.submit(train(2))
    b = stack.submit(train(4, depends_on=[{"job_id": a["id"]}], resume_from={"job_id": a["id"]}))
    with stack.client() as c:
        waiting = c.get(f"/v1/jobs/{b['id']}").json()
    a_done, b_done = stack.wait_job(a["id"]), stack.wait_job(b["id"])
    assert a_done["state"] == b_done["state"] == "succeeded", (a_done["error"], b_done["error"])
    assert waiting["state"] == "queued"
    assert datetime.fromisoformat(b_done["attempts"][0]["started_at"]) >= datetime.fromisoformat(
        a_done["finished_at"]
    )
    progress = [e["data"] for e in stack.events(b["id"]) if e["type"] == "progress"]
    assert progress and min(p["epoch"] for p in progress if p.get("epoch") is not None) >= 2, progress[:3]
    assert b_done["progress"]["epoch"] == 4
    first_b = [e for e in stack.events(b["id"]) if e["type"] == "checkpoint"][0]["data"]
    assert first_b["epoch"] == 3  # B trained epochs 3 and 4 only: 1 and 2 were A's


def test_a_failing_fails_b_naming_a_and_a_future_job_is_refused(stack: Stack) -> None:
    a = stack.submit(script_job("fail.py"))
    b = stack.submit(train(1, depends_on=[{"job_id": a["id"]}]))
    assert stack.wait_job(a["id"])["state"] == "failed"
    b_done = stack.wait_job(b["id"], timeout=60)
    assert b_done["state"] == "failed"
    assert b_done["error"] == f"dependency job {a['id']} failed: the condition 'succeeded' can never hold"
    with stack.client() as c:
        ahead = c.post("/v1/jobs", json=train(1, depends_on=[{"job_id": b["id"] + 1}]))
    assert ahead.status_code == 422 and ahead.json()["detail"][0]["loc"] == [
        "body",
        "depends_on",
        0,
        "job_id",
    ]
