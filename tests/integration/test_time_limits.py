"""Contract §8 with real torchrun and real processes: a hung job is found, its stacks are
written into its logs, and it is stopped; a job past its time limit checkpoints and fails."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.testing import harness
from service.testing.harness import Stack, pids_of_job, wait_event


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = harness.embedded_stack(tmp_path, warm=False)
    yield s
    s.stop()


def rank_log(stack: Stack, job_id: int, rank: int, attempt: int) -> str:
    with stack.client() as c:
        resp = c.get(f"/v1/jobs/{job_id}/logs", params={"node": 0, "rank": rank, "attempt": attempt})
    assert resp.status_code == 200, resp.text
    return resp.text


HANG = {
    "mode": "ddp",
    "gpus_per_node": 2,
    "entrypoint": {"kind": "script", "path": "hang_before_allreduce.py"},
    "stall_timeout_s": 20,
    "max_retries": 1,
}


def test_a_hung_ddp_job_has_every_stack_in_its_logs_then_stops_and_retries(stack: Stack) -> None:
    job = stack.submit(HANG)
    assert job["stall_timeout_s"] == 20
    started = time.monotonic()
    wait_event(stack, job["id"], lambda e: e["type"] == "stall", timeout=90)
    assert time.monotonic() - started < 60 + 30  # the ranks' start, 20 s of silence, the dumps
    done = stack.wait_job(job["id"], timeout=180)
    assert done["state"] == "failed"
    assert done["attempt"] == 2, "the stall is an infrastructure failure: retried once"
    assert done["error"].startswith("stalled"), done["error"]
    assert all(a["reason"] and "stalled" in a["reason"] for a in done["attempts"]), done["attempts"]
    for attempt in (1, 2):
        waiting, hung = rank_log(stack, job["id"], 0, attempt), rank_log(stack, job["id"], 1, attempt)
        assert "[stall]" in waiting and "[stall]" in hung
        assert "all_reduce" in waiting.split("[stall]", 1)[1], waiting
        assert "wait_forever_before_allreduce" in hung.split("[stall]", 1)[1], hung
    stalls = [e["data"] for e in stack.events(job["id"]) if e["type"] == "stall"]
    assert {(d["node_rank"], d["rank"]) for d in stalls} == {(0, 0), (0, 1)}
    assert all(d["seconds"] >= 20 for d in stalls)
    assert pids_of_job(job["id"], stack.home) == []
    # contract §9: both attempts held 2 GPUs, and the job's GPU-seconds are their sum
    assert [a["gpus"] for a in done["attempts"]] == [2, 2]
    assert all(a["gpu_seconds"] >= 2 * 20 for a in done["attempts"]), done["attempts"]
    assert done["gpu_seconds"] == pytest.approx(sum(a["gpu_seconds"] for a in done["attempts"]), abs=0.01)


def test_stall_timeout_null_never_judges_a_silent_job(stack: Stack) -> None:
    """Off is off: the same hang with `stall_timeout_s: null` still runs past the timeout
    the other test used, and stops only when cancelled."""
    job = stack.submit({**HANG, "stall_timeout_s": None, "max_retries": 0})
    assert job["stall_timeout_s"] is None
    stack.wait_job(job["id"], states=("running",), timeout=60)
    time.sleep(35)
    assert not [e for e in stack.events(job["id"]) if e["type"] == "stall"]
    with stack.client() as c:
        assert c.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)
    assert stack.wait_job(job["id"])["state"] == "cancelled"


def test_a_job_past_its_time_limit_checkpoints_then_fails(stack: Stack) -> None:
    job = stack.submit(
        {
            "mode": "single",
            "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "synthetic"},
            "hyperparameters": {"epochs": 5000, "num_workers": 0, "checkpoint_every": 5000},
            "max_duration_s": 15,
            "max_retries": 2,
        }
    )
    wait_event(stack, job["id"], lambda e: e["type"] == "progress")
    started = time.monotonic()
    done = stack.wait_job(job["id"], timeout=15 + 30 + 30)
    assert time.monotonic() - started < 15 + 30
    assert done["state"] == "failed"
    assert done["error"].startswith("time limit"), done["error"]
    assert done["attempt"] == 1, "a time limit is not retried"
    assert done["latest_checkpoint"] is not None, "rank 0 checkpointed at the stop"
    assert pids_of_job(job["id"], stack.home) == []
