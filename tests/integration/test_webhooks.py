"""Contract §10, webhooks on the production stack (PostgreSQL, Redis, a real Celery worker and
torchrun): a receiver on 127.0.0.1 (allowed by the setting) answers 500 to its first three
calls and is down for 20 s mid-run, and the API server is killed and started again meanwhile.
Every state event of the job still arrives (and every progress event: the webhook asks for
both, so that events keep coming while the receiver is down), in order, each exactly once with
a 2xx, every signature verifies; and without the setting a URL that resolves to loopback is a
422."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.testing import harness
from service.testing.harness import Stack, wait_event, wait_for
from tests.service.webhooks.receiver import Receiver

SECRET = "integration-secret-0123456789"
DOWN_S = 20
# A single-process job of some seconds: still running (and reporting) while the receiver is down.
TRAIN = {
    "mode": "single",
    "entrypoint": {"kind": "builtin", "model": "cnn", "dataset": "synthetic"},
    "hyperparameters": {"epochs": 3, "synthetic_size": 8000, "num_workers": 0, "seed": 5},
}
QUICK = {**TRAIN, "hyperparameters": {"epochs": 1, "synthetic_size": 512, "num_workers": 0}}


@pytest.fixture
def stack(tmp_path: Path, pg_url: str, redis_url: str) -> Iterator[Stack]:
    s = harness.production_stack(
        tmp_path,
        pg_url,
        redis_url,
        workers={"w1": 2},
        warm=False,
        TORCHJOBS_WEBHOOK_ALLOW_PRIVATE="true",
        TORCHJOBS_WEBHOOK_BACKOFF_INITIAL_S="0.2",
        TORCHJOBS_WEBHOOK_BACKOFF_MAX_S="1",
        TORCHJOBS_WEBHOOK_POLL_S="0.2",
        TORCHJOBS_WEBHOOK_TIMEOUT_S="2",
    )
    yield s
    s.stop()


def wanted_events(stack: Stack, job_id: int) -> list[dict]:
    return [e for e in stack.events(job_id) if e["type"] in ("state", "progress")]


def history(stack: Stack, token: str, hook_id: int) -> list[dict]:
    """Every delivery of the webhook, newest first, page by page."""
    items: list[dict] = []
    cursor = None
    with stack.client(token) as c:
        while True:
            params = {"limit": 100, **({"cursor": cursor} if cursor else {})}
            page = c.get(f"/v1/webhooks/{hook_id}/deliveries", params=params).json()
            items += page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                return items


def tried_unanswered(stack: Stack, token: str, hook_id: int) -> bool:
    return any(a["status_code"] is None for d in history(stack, token, hook_id) for a in d["attempts"])


def test_every_state_event_arrives_once_in_order_through_failures_downtime_and_a_restart(
    stack: Stack, pg_url: str, tmp_path: Path
) -> None:
    receiver = Receiver(fail_first=3).start()
    try:
        with stack.client() as admin:
            token = admin.post("/v1/users", json={"name": "hooked"}).json()["token"]
        with stack.client(token) as c:
            hook = c.post(
                "/v1/webhooks", json={"url": receiver.url, "events": ["state", "progress"], "secret": SECRET}
            )
            assert hook.status_code == 201, hook.text
        job = stack.submit(TRAIN, token=token)
        other = stack.submit(QUICK)  # the admin's: not for her webhook

        wait_event(stack, job["id"], lambda e: e["type"] == "progress")
        wait_for(
            lambda: any(json.loads(c.body)["event"]["type"] == "progress" for c in receiver.delivered()),
            60,
            "a progress event delivered",
        )
        receiver.stop()  # down, mid-run
        down_at = time.monotonic()
        wait_for(lambda: tried_unanswered(stack, token, hook.json()["id"]), 60, "a try while it is down")
        stack.kill("server")  # and the API killed (SIGKILL), then started again, while it is down
        time.sleep(2)
        stack.start_server()
        time.sleep(max(0.0, DOWN_S - (time.monotonic() - down_at)))
        calls_before = len(receiver.calls)
        receiver.start()  # back, on the same port

        done = stack.wait_job(job["id"], timeout=240)
        assert done["state"] == "succeeded", done["error"]
        expected = wanted_events(stack, job["id"])
        wait_for(lambda: len(receiver.delivered()) >= len(expected), 150, "every event delivered")
        time.sleep(2)  # anything sent twice would arrive now
        stack.wait_job(other["id"], timeout=240)
    finally:
        receiver.stop()

    delivered = [json.loads(c.body) for c in receiver.delivered()]
    assert [d["event"] for d in delivered] == expected  # every one, in seq order, once each
    assert {d["job_id"] for d in delivered} == {job["id"]}  # not the admin's job: not hers
    states = [e["data"]["state"] for e in expected if e["type"] == "state"]
    assert states == ["queued", "scheduled", "running", "succeeded"]
    assert [e for e in expected if e["type"] == "state"] == [
        e for e in stack.events(job["id"]) if e["type"] == "state"
    ]
    assert [c.status for c in receiver.calls[:3]] == [500, 500, 500]
    ids = [c.headers["x-torchjobs-event-id"] for c in receiver.calls]
    for event_id in set(ids):
        answers = [c.status for c in receiver.calls if c.headers["x-torchjobs-event-id"] == event_id]
        assert answers[-1] == 200 and all(a != 200 for a in answers[:-1]), (event_id, answers)
    assert ids == sorted(ids, key=lambda i: int(i.split(":")[1]))  # never one before the one ahead
    assert all(c.verifies(SECRET) for c in receiver.calls)
    assert len(receiver.calls) > calls_before  # events waited out the downtime and the restart

    recorded = history(stack, token, hook.json()["id"])
    assert sorted(d["seq"] for d in recorded) == [e["seq"] for e in expected]
    assert all(d["status"] == "delivered" for d in recorded)
    attempts = [a for d in recorded for a in d["attempts"]]
    assert sum(a["status_code"] == 500 for a in attempts) == 3
    assert any(a["status_code"] is None and a["error"] for a in attempts)  # tried while it was down

    # Without the setting, a name that resolves to loopback is refused.
    strict = Settings(
        home=tmp_path / "strict",
        database_url=pg_url,
        admin_token=harness.ADMIN_TOKEN,
        webhook_allow_private=False,
    )
    with TestClient(create_app(strict, scheduler=False)) as api:
        refused = api.post(
            "/v1/webhooks", json={"url": f"http://localhost:{receiver.port}/"}, headers=harness.auth()
        )
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["loc"] == ["body", "url"]
