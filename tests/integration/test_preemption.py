"""Contract §12 with a real Celery worker (2 slots) on PostgreSQL and Redis, real torchrun:
a higher priority preempts a running job, which checkpoints on SIGTERM, is queued again and
resumes from that checkpoint; equal priorities and `preemptible: false` are left alone; a
drained worker stops its jobs and takes none until readmitted."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest
import torch

from service.testing.harness import Stack, pids_of_job, script_job, wait_event, wait_for
from tests.integration.weights import final_weights


@pytest.fixture(scope="module")
def stack(production: Stack) -> Stack:
    """The module's stack: one worker `w1` with 2 slots, PostgreSQL and Redis (conftest)."""
    return production


def spec(epochs: int, gpus: int, **extra: Any) -> dict[str, Any]:
    """A builtin job that checkpoints only when asked to stop (and at its end)."""
    hyper = {
        "epochs": epochs,
        "synthetic_size": 512,
        "batch_size": 64,
        "num_workers": 0,
        "checkpoint_every": 10_000,
    }
    return {
        "mode": "ddp" if gpus > 1 else "single",
        "gpus_per_node": gpus,
        "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "synthetic"},
        "hyperparameters": hyper,
        "stop_grace_s": 20,
        **extra,
    }


def event_of(stack: Stack, job_id: int, type_: str, timeout: float) -> Any:
    try:
        return wait_event(stack, job_id, lambda e: e["type"] == type_, timeout=timeout)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n{stack.describe(job_id)}") from None


def cancel(stack: Stack, *job_ids: int) -> None:
    with stack.client() as c:
        for job_id in job_ids:
            c.post(f"/v1/jobs/{job_id}/cancel")
    for job_id in job_ids:
        stack.wait_job(job_id, timeout=60)


def rank0_log(stack: Stack, job_id: int, attempt: int) -> str:
    with stack.client() as c:
        resp = c.get(f"/v1/jobs/{job_id}/logs", params={"node": 0, "rank": 0, "attempt": attempt})
    assert resp.status_code == 200, resp.text
    return resp.text


def test_a_higher_priority_preempts_a_running_job_which_checkpoints_and_resumes(stack: Stack) -> None:
    low = stack.submit(spec(epochs=60, gpus=2))
    assert (low["preemptible"], low["stop_grace_s"], low["max_retries"]) == (True, 20, 0)
    event_of(stack, low["id"], "progress", 90)
    high = stack.submit(spec(epochs=2, gpus=1, priority=5))
    # after the victim in the queue, of its priority: the same job, run straight through
    later = stack.submit(spec(epochs=60, gpus=2))
    preempted = event_of(stack, low["id"], "preempted", 30)
    assert preempted["data"] == {"by_priority": 5, "by_job": high["id"]}  # the admin sees who
    with stack.client() as c:  # its first attempt ends within the grace: it is queued again
        wait_for(lambda: c.get(f"/v1/jobs/{low['id']}").json()["attempt"] == 2, 60, "attempt 2")
    done_high = stack.wait_job(high["id"], timeout=120)
    assert done_high["state"] == "succeeded", stack.describe(high["id"])
    done = stack.wait_job(low["id"], timeout=180)
    assert done["state"] == "succeeded", stack.describe(low["id"])
    assert done["attempt"] == 2 and done["max_retries"] == 0
    first, second = done["attempts"]
    assert first["reason"] == "preempted" and second["reason"] != "preempted"
    # no double booking: the preemptor started only once the victim's first attempt had ended
    assert done_high["attempts"][0]["started_at"] >= first["finished_at"]
    # it kept its place: it ran again before the job of its priority submitted after it
    later_done = stack.wait_job(later["id"], timeout=180)
    assert later_done["attempts"][0]["started_at"] >= second["started_at"]
    # rank 0 checkpointed at SIGTERM, and the second attempt resumed from that checkpoint
    assert "resuming at epoch" in rank0_log(stack, low["id"], 2)
    with stack.client() as c:
        ckpts = c.get(f"/v1/jobs/{low['id']}/checkpoints").json()["items"]
    assert ckpts and ckpts[0]["created_at"] <= second["started_at"], (ckpts, second)
    kinds = [(e["type"], e["data"].get("state")) for e in stack.events(low["id"])]
    assert kinds.index(("preempted", None)) < kinds.index(("state", "queued"), 1)
    assert pids_of_job(low["id"], stack.home) == []
    # preempted mid-run and resumed, it ends bitwise where the same job run straight ends (CPU)
    assert later_done["state"] == "succeeded", stack.describe(later["id"])
    preempted_weights, straight_weights = final_weights(stack, done), final_weights(stack, later_done)
    assert preempted_weights.keys() == straight_weights.keys()
    assert all(torch.equal(preempted_weights[k], straight_weights[k]) for k in preempted_weights)


def test_equal_priority_and_a_job_not_preemptible_are_not_preempted(stack: Stack) -> None:
    pinned = stack.submit(spec(epochs=10_000, gpus=1, preemptible=False))
    peer = stack.submit(spec(epochs=10_000, gpus=1, priority=5))
    for job in (pinned, peer):
        stack.wait_job(job["id"], states=("running",), timeout=90)
    same = stack.submit(spec(epochs=1, gpus=1, priority=5))
    higher = stack.submit(spec(epochs=1, gpus=1, priority=3))  # outranks only the pinned job
    time.sleep(6)  # several scheduler passes
    for job in (pinned, peer):
        assert not [e for e in stack.events(job["id"]) if e["type"] == "preempted"]
    with stack.client() as c:
        waiting = c.get(f"/v1/jobs/{same['id']}").json()
    assert waiting["state"] == "queued" and waiting["pending_reason"], waiting
    with stack.client() as c:
        assert c.get(f"/v1/jobs/{higher['id']}").json()["state"] == "queued"
    cancel(stack, same["id"], higher["id"], pinned["id"], peer["id"])


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(stack: Stack) -> None:
    stubborn = stack.submit(
        {**script_job("ignore_sigterm.py"), "mode": "ddp", "gpus_per_node": 2, "stop_grace_s": 3}
    )
    stack.wait_job(stubborn["id"], states=("running",), timeout=90)
    wait_for(lambda: "still here" in rank0_log(stack, stubborn["id"], 1), 60, "the rank to run")
    high = stack.submit(spec(epochs=1, gpus=1, priority=5))
    stopped = event_of(stack, stubborn["id"], "preempted", 30)
    with stack.client() as c:
        wait_for(lambda: c.get(f"/v1/jobs/{stubborn['id']}").json()["attempt"] == 2, 60, "attempt 2")
        first = c.get(f"/v1/jobs/{stubborn['id']}").json()["attempts"][0]
    assert first["reason"] == "preempted"
    given = datetime.fromisoformat(first["finished_at"]) - datetime.fromisoformat(stopped["ts"])
    assert given.total_seconds() >= 3, (stopped, first)  # its grace, then SIGKILL
    assert "ignoring SIGTERM" in rank0_log(stack, stubborn["id"], 1)  # (the script ran)
    assert stack.wait_job(high["id"], timeout=120)["state"] == "succeeded"
    cancel(stack, stubborn["id"])
    assert pids_of_job(stubborn["id"], stack.home) == []


def test_drain_stops_jobs_and_places_nothing_until_readmitted(stack: Stack) -> None:
    with stack.client() as c:
        bob = c.post("/v1/users", json={"name": "bob-drain"}).json()["token"]
    with stack.client(bob) as c:
        assert c.post("/v1/workers/w1/drain").status_code == 403
    with stack.client() as c:
        assert c.post("/v1/workers/nope/drain").status_code == 404
    job = stack.submit(spec(epochs=10_000, gpus=2, preemptible=False, stop_grace_s=5))
    event_of(stack, job["id"], "progress", 90)
    with stack.client() as c:
        drained = c.post("/v1/workers/w1/drain")
        assert drained.status_code == 200 and drained.json()["state"] == "draining", drained.text
        assert c.post("/v1/workers/w1/drain").json()["state"] in ("draining", "drained")  # idempotent
    stopped = event_of(stack, job["id"], "preempted", 30)
    assert stopped["data"] == {"by_priority": None, "drained": "w1"}
    stack.wait_job(job["id"], states=("queued",), timeout=60)

    def state() -> str | None:
        with stack.client() as c:
            workers = {w["name"]: w for w in c.get("/v1/workers").json()["items"]}
        return workers["w1"]["state"] if workers["w1"]["state"] == "drained" else None

    wait_for(state, 30, "w1 drained")
    time.sleep(3)  # passes go by: nothing is placed there
    with stack.client() as c:
        waiting = c.get(f"/v1/jobs/{job['id']}").json()
        assert waiting["state"] == "queued" and waiting["attempt"] == 2, waiting
        assert waiting["attempts"][0]["reason"] == "preempted"
        readmitted = c.post("/v1/workers/w1/readmit")
        assert readmitted.status_code == 200 and readmitted.json()["state"] == "online", readmitted.text
    stack.wait_job(job["id"], states=("running",), timeout=90)
    cancel(stack, job["id"])
    assert pids_of_job(job["id"], stack.home) == []
