"""Contract §8, a sick host: a worker whose ranks can never pass the pre-flight (its gloo is
bound to an interface that does not exist, its jobs on the host's network) fails attempt after
attempt; after three in a row it is quarantined, work goes to the healthy host, and the
admin's readmit brings it back."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.testing import harness
from service.testing.harness import Stack, wait_for

DDP = {
    "mode": "ddp",
    "gpus_per_node": 2,
    "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "synthetic"},
    "hyperparameters": {"epochs": 1, "synthetic_size": 256, "num_workers": 0},
}


@pytest.fixture
def stack(tmp_path: Path, pg_url: str, redis_url: str) -> Iterator[Stack]:
    s = harness.production_stack(tmp_path, pg_url, redis_url, workers={})
    # jobs on the host's network: a job node in its own namespace is not told the host's
    # interface names, so there the bad one would harm only multi-node jobs
    sick = {"GLOO_SOCKET_IFNAME": "tj-nosuchnic0", "TORCHJOBS_JOB_NETWORK": "host"}
    s.start_worker("sick", 2, extra_env=sick)
    yield s
    s.stop()


def cli(stack: Stack, *args: str) -> str:
    env = {**stack.env, "TORCHJOBS_URL": stack.url, "TORCHJOBS_TOKEN": harness.ADMIN_TOKEN}
    done = subprocess.run(harness.torchjobs_cmd(*args), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_three_infrastructure_failures_in_a_row_quarantine_a_host_until_readmitted(stack: Stack) -> None:
    failing = stack.wait_job(stack.submit({**DDP, "max_retries": 2})["id"])
    assert failing["state"] == "failed" and failing["attempt"] == 3
    assert "pre-flight could not" in failing["error"], failing["error"]
    sick = stack.worker("sick")
    assert sick is not None and sick["state"] == "quarantined" and sick["gpus_free"] == 0
    assert sick["reason"].startswith("3 attempts in a row ended in an infrastructure failure"), sick
    assert "pre-flight could not" in sick["reason"]
    assert "quarantined" in cli(stack, "workers")
    [told] = [e["data"] for e in stack.events(failing["id"]) if e["type"] == "quarantine"]
    assert told["worker"] == "sick" and told["reason"] == sick["reason"]

    stack.start_worker("well", 2)
    done = stack.wait_job(stack.submit(DDP)["id"])
    assert done["state"] == "succeeded", done["error"]
    assert {a["worker"] for a in done["assignments"]} == {"well"}

    two_nodes = stack.submit({**DDP, "nodes": 2, "gpus_per_node": 1})
    with stack.client() as c:

        def reason() -> str | None:
            job = c.get(f"/v1/jobs/{two_nodes['id']}").json()
            return job["pending_reason"] if "quarantined" in (job["pending_reason"] or "") else None

        said = wait_for(reason, 30, "the pending reason to name the quarantined host")
        assert "sick" in said
        assert c.post(f"/v1/jobs/{two_nodes['id']}/cancel").status_code in (200, 202)
    stack.wait_job(two_nodes["id"])

    assert cli(stack, "workers", "readmit", "sick").strip() == "sick: online"
    back = stack.worker("sick")
    assert back is not None and (back["state"], back["reason"], back["infra_failures"]) == ("online", None, 0)
