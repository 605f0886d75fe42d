"""Issue 4: logs kept whole and served by offset and as a stream; the CLI's `watch` and
`logs -f`; clients that survive dropped connections. Real jobs on PostgreSQL + Redis."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import subprocess
import threading

import httpx
import pytest

from service.client import Client
from service.testing import harness
from service.testing.harness import ADMIN_TOKEN, Stack
from tests.service.streams.sse import DroppingProxy, Received, auth, read_sse, script_job

PAGE = 1_048_576


def _chatty():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("chatty", harness.SCRIPTS / "chatty.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _all_logs(stack: Stack, job_id: int) -> bytes:
    parts, offset = [], 0
    with stack.client() as c:
        while True:
            resp = c.get(f"/v1/jobs/{job_id}/logs", params={"offset": offset})
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
            nxt = int(resp.headers["X-Next-Offset"])
            assert len(resp.content) <= PAGE and nxt == offset + len(resp.content)
            if not resp.content:
                return b"".join(parts)
            parts.append(resp.content)
            offset = nxt


def _cli(stack: Stack, *args: str, url: str | None = None) -> subprocess.Popen[bytes]:
    env = {**stack.env, "TORCHJOBS_URL": url or stack.url, "TORCHJOBS_TOKEN": ADMIN_TOKEN}
    return subprocess.Popen(
        harness.torchjobs_cmd(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def test_fifty_megabytes_printed_are_stored_and_served_byte_for_byte(prod: Stack) -> None:
    chatty = _chatty()
    job_id = prod.submit(script_job("chatty.py", "50"))["id"]
    done = prod.wait_job(job_id, timeout=200)
    assert done["state"] == "succeeded", done["error"]
    expected = chatty.expected(50)
    assert len(expected) > 50_000_000

    got = _all_logs(prod, job_id)
    assert len(got) == len(expected)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(expected).hexdigest()
    assert got.endswith(chatty.LAST_WORDS.encode())  # what it printed just before exiting

    with prod.client() as c:  # an offset inside a stored chunk, and one past the end
        middle = 12_345_677
        resp = c.get(f"/v1/jobs/{job_id}/logs", params={"offset": middle, "attempt": 1})
        assert resp.content == expected[middle : middle + PAGE]
        resp = c.get(f"/v1/jobs/{job_id}/logs", params={"offset": len(expected) + 10})
        assert resp.content == b"" and resp.headers["X-Next-Offset"] == str(len(expected) + 10)

    # The same bytes as a stream, from a line start near the end, and resumed by Last-Event-ID.
    start = expected.rfind(b"\n", 0, len(expected) - 600_000) + 1
    path = f"/v1/jobs/{job_id}/logs/stream"

    async def scenario() -> tuple[Received, Received]:
        async with httpx.AsyncClient(base_url=prod.url, headers=auth()) as c:
            whole = await read_sse(c, path, params={"offset": start})
            resume_at = whole.messages[0].id
            resumed = await read_sse(c, path, headers={"Last-Event-ID": resume_at})
            return whole, resumed

    whole, resumed = asyncio.run(scenario())
    logs = [m for m in whole.messages if m.event == "log"]
    assert len(logs) >= 2 and whole.messages[-1].event == "end"
    assert whole.messages[-1].json() == {"offset": len(expected), "attempt": 1, "state": "succeeded"}
    assert "".join(m.json()["data"] for m in logs) == expected[start:].decode()
    assert [m.json()["offset"] for m in logs[1:]] == [m.json()["next_offset"] for m in logs[:-1]]
    assert all(m.id == str(m.json()["next_offset"]) for m in logs)
    resumed_text = "".join(m.json()["data"] for m in resumed.messages if m.event == "log")
    assert resumed_text == expected[int(whole.messages[0].id) :].decode()


def test_cli_watch_exit_codes_and_logs_follow(prod: Stack) -> None:
    ok = prod.submit(script_job("progress.py", "20", "0.1"))["id"]
    follow = _cli(prod, "logs", "-f", str(ok))
    watch_ok = _cli(prod, "watch", str(ok))
    failing = prod.submit(script_job("fail.py"))["id"]
    watch_failing = _cli(prod, "watch", str(failing))

    out, err = watch_ok.communicate(timeout=120)
    assert watch_ok.returncode == 0, err.decode()
    assert f"job {ok} succeeded" in err.decode()
    out, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err.decode()
    assert out == _all_logs(prod, ok) == b"".join(b"rank 0 step %d/20\n" % i for i in range(1, 21))
    out, err = watch_failing.communicate(timeout=120)
    assert watch_failing.returncode == 1, err.decode()
    assert f"job {failing} failed" in err.decode()

    long = prod.submit(script_job("progress.py", "300", "0.1"))["id"]
    watch_cancelled = _cli(prod, "watch", str(long), "-o", "json")
    prod.wait_job(long, states=("running",), timeout=120)
    with prod.client() as c:
        assert c.post(f"/v1/jobs/{long}/cancel").status_code == 202
    out, err = watch_cancelled.communicate(timeout=120)
    assert watch_cancelled.returncode == 3, err.decode()
    lines = out.decode().splitlines()
    assert '"cancelled"' in lines[-1]  # -o json: one event a line, the terminal state last


@pytest.mark.timeout(240)
def test_clients_survive_dropped_connections(prod: Stack) -> None:
    """Each stream's first connections are cut mid-message; the client resumes where it was."""
    job_id = prod.submit(script_job("progress.py", "30", "0.05"))["id"]
    event_proxy = DroppingProxy(prod.port, after_bytes=900, drops=3)
    log_proxy = DroppingProxy(prod.port, after_bytes=400, drops=3)
    follow = _cli(prod, "logs", "-f", str(job_id), url=log_proxy.url)
    got: list[dict] = []
    reader = threading.Thread(
        target=lambda: got.extend(Client(event_proxy.url, ADMIN_TOKEN).stream_events(job_id)), daemon=True
    )
    reader.start()
    out, err = follow.communicate(timeout=180)
    reader.join(timeout=180)
    try:
        assert follow.returncode == 0, err.decode()
        assert event_proxy.dropped >= 1 and log_proxy.dropped >= 1
        assert got == prod.events(job_id)
        assert out == _all_logs(prod, job_id)
        with Client(log_proxy.url, ADMIN_TOKEN) as client:
            again = [m for m in client.stream_logs(job_id) if m["type"] == "log"]
        assert "".join(m["data"] for m in again).encode() == out
    finally:
        event_proxy.close()
        log_proxy.close()
