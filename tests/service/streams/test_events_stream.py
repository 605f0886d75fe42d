"""Issue 4: a job's events over Server-Sent Events, from a real job on real processes.

Every test runs a real torchrun job (tests/scripts/progress.py reports progress through the
TORCHJOBS_EVENTS file) and reads the stream as a client would, over HTTP. On `prod`
(PostgreSQL + Redis) the streams' recheck timer is ten minutes, so each event that arrives in
time came through the Redis wake-up; on `emb` (SQLite, no Redis) through the shared poller.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from service.testing.harness import ADMIN_TOKEN, Stack
from tests.service.streams.sse import Received, auth, is_terminal, read_sse, script_job


@pytest.fixture(params=["prod", "emb"])
def stack(request: pytest.FixtureRequest) -> Stack:
    return request.getfixturevalue(request.param)


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def _assert_wire_format(got: Received) -> None:
    for message in got.messages:
        event = message.json()
        assert set(event) == {"seq", "ts", "type", "data"}
        assert message.id == str(event["seq"]) and message.event == event["type"]


def test_every_event_once_in_order_and_resume_after_k(stack: Stack) -> None:
    job_id = stack.submit(script_job("progress.py", "40", "0.05"))["id"]
    path = f"/v1/jobs/{job_id}/events/stream"
    k = 6

    async def scenario() -> tuple[Received, ...]:
        async with httpx.AsyncClient(base_url=stack.url, headers=auth()) as c:
            full = asyncio.create_task(read_sse(c, path))
            first = await read_sse(c, path, stop_after_id=str(k))  # hangs up after event k
            resumed, larger = await asyncio.gather(
                read_sse(c, path, headers={"Last-Event-ID": str(k)}),
                read_sse(c, path, params={"after": k}, headers={"Last-Event-ID": "2"}),
            )
            return await full, first, resumed, larger

    full, first, resumed, larger = _run(scenario())
    events = stack.events(job_id)
    n = len(events)
    assert [e["seq"] for e in events] == list(range(1, n + 1))
    assert is_terminal(events[-1]) and events[-1]["data"]["state"] == "succeeded"
    assert sum(e["type"] == "progress" for e in events) == 40

    assert full.events == events  # every event, once, in order, then the stream closed
    _assert_wire_format(full)
    assert first.seqs == list(range(1, k + 1))
    assert resumed.seqs == list(range(k + 1, n + 1))
    assert first.events + resumed.events == events
    assert larger.seqs == list(range(k + 1, n + 1))  # ?after= and Last-Event-ID: the larger wins

    async def after_the_end() -> tuple[Received, Received]:
        async with httpx.AsyncClient(base_url=stack.url, headers=auth()) as c:
            return await asyncio.gather(
                read_sse(c, path, headers={"Last-Event-ID": str(n - 3)}),
                read_sse(c, path, params={"after": n}),
            )

    rest, nothing = _run(after_the_end())
    assert rest.events == events[n - 3 :]  # a job that already ended: what is left, then close
    assert nothing.status == 200 and nothing.messages == []


def test_fifty_concurrent_streams_all_receive_everything(stack: Stack) -> None:
    job_id = stack.submit(script_job("progress.py", "30", "0.05"))["id"]
    path = f"/v1/jobs/{job_id}/events/stream"

    async def scenario() -> list[Received]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=stack.url, headers=auth(), limits=limits) as c:
            return await asyncio.gather(*(read_sse(c, path) for _ in range(50)))

    results = _run(scenario())
    events = stack.events(job_id)
    assert is_terminal(events[-1]) and len(events) >= 34
    for got in results:
        assert got.status == 200
        assert got.events == events


def test_keepalive_comments_while_idle_and_progress_metrics(prod: Stack) -> None:
    # Two reports 2.5 s apart: the stream is idle for longer than the 1 s ping interval.
    job_id = prod.submit(script_job("progress.py", "2", "2.5"))["id"]

    async def scenario() -> Received:
        async with httpx.AsyncClient(base_url=prod.url, headers=auth()) as c:
            return await read_sse(c, f"/v1/jobs/{job_id}/events/stream")

    got = _run(scenario())
    assert "ping" in got.comments
    assert got.events == prod.events(job_id)

    with prod.client() as c:
        series = c.get(f"/v1/jobs/{job_id}/metrics").json()["series"]
        job = c.get(f"/v1/jobs/{job_id}").json()
    assert [p["step"] for p in series] == [1, 2]
    for point in series:
        assert {"step", "epoch", "loss", "samples_per_sec", "val_accuracy"} <= set(point)
    assert series[-1]["loss"] == 0.5 and series[-1]["val_accuracy"] == 1.0
    assert series[-1]["samples_per_sec"] == 1002.0
    progress = job["progress"]
    assert (progress["step"], progress["total_steps"], progress["epoch"]) == (2, 2, 2)
    assert progress["loss"] == 0.5 and progress["samples_per_sec"] == 1002.0
    assert progress["val_accuracy"] == 1.0 and progress["fraction"] == 1.0


def test_unknown_or_other_users_job_is_404_everywhere(prod: Stack) -> None:
    job_id = prod.submit(script_job("progress.py", "1", "0"))["id"]
    with prod.client() as admin:
        resp = admin.post("/v1/users", json={"name": f"mallory-{uuid.uuid4().hex[:8]}"})
        assert resp.status_code == 201
        other = resp.json()["token"]
    routes = ["events", "events/stream", "logs", "logs/stream", "metrics"]
    with httpx.Client(base_url=prod.url, timeout=30) as c:
        for token, target in ((other, job_id), (ADMIN_TOKEN, 10**9)):
            for route in routes:
                resp = c.get(f"/v1/jobs/{target}/{route}", headers=auth(token))
                assert resp.status_code == 404, (route, resp.text)
                assert resp.json() == {"detail": "job not found"}
        for route in routes:
            assert c.get(f"/v1/jobs/{job_id}/{route}").status_code == 401

        bad = [
            ("logs", {"node": -1}),
            ("logs", {"rank": -1}),
            ("logs", {"offset": -1}),
            ("logs", {"attempt": 0}),
            ("logs", {"node": 1}),  # a one-node job
            ("logs", {"attempt": 2}),  # it has had one attempt
            ("logs/stream", {"offset": -1}),
            ("logs/stream", {"node": 3}),
            ("events/stream", {"after": -1}),
            ("events", {"after": -1}),
        ]
        for route, params in bad:
            resp = c.get(f"/v1/jobs/{job_id}/{route}", params=params, headers=auth())
            assert resp.status_code == 422, (route, params, resp.text)
        resp = c.get(f"/v1/jobs/{job_id}/events/stream", headers={**auth(), "Last-Event-ID": "abc"})
        assert resp.status_code == 422
    prod.wait_job(job_id)
