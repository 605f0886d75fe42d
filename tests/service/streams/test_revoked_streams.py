"""A revoked token ends the event and log streams it opened (contract §7), on both setups.

Before, a stream checked its caller once, when it opened: one opened before the revoke went
on for as long as the job ran (past 45 s when this was found). Now each stream asks again at
least every TORCHJOBS_STREAM_RECHECK_S (2 s here) and ends; the job, which runs for a minute,
is still running when both have ended.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.testing import harness
from service.testing.harness import Stack

LONG = {"mode": "single", "entrypoint": {"kind": "script", "path": "progress.py", "args": ["1200", "0.05"]}}


@pytest.fixture(params=["embedded", "production"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    if request.param == "embedded":
        s = harness.embedded_stack(
            tmp_path, harness.make_env(tmp_path, TORCHJOBS_STREAM_RECHECK_S="2"), warm=False
        )
        yield s
        s.stop()
        return
    pg = harness.create_pg_database(migrated=True)
    s = harness.production_stack(
        tmp_path, pg, f"{harness.REDIS_URL}/13", warm=False, TORCHJOBS_STREAM_RECHECK_S="2"
    )
    yield s
    s.stop()
    harness.drop_pg_database(pg)


def _read_until_closed(url: str, token: str, ended: threading.Event, opened: threading.Event) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    timeout = httpx.Timeout(10, read=120)
    with httpx.Client(timeout=timeout) as c, c.stream("GET", url, headers=headers) as resp:
        assert resp.status_code == 200
        opened.set()
        for _ in resp.iter_lines():
            pass
    ended.set()


def test_a_revoked_token_ends_the_streams_it_opened(stack: Stack) -> None:
    with stack.client() as c:
        user = c.post("/v1/users", json={"name": "leaver"}).json()
    job = stack.submit(LONG, user["token"])
    harness.wait_event(stack, job["id"], lambda e: e["type"] == "progress")
    paths = [f"/v1/jobs/{job['id']}/events/stream", f"/v1/jobs/{job['id']}/logs/stream"]
    ended = [threading.Event() for _ in paths]
    opened = [threading.Event() for _ in paths]
    for path, done, up in zip(paths, ended, opened, strict=True):
        threading.Thread(
            target=_read_until_closed, args=(stack.url + path, user["token"], done, up), daemon=True
        ).start()
    assert all(up.wait(30) for up in opened)
    with stack.client() as c:
        assert c.delete(f"/v1/users/{user['id']}/tokens").status_code == 204
    assert all(done.wait(60) for done in ended), "a stream went on after its token was revoked"
    with stack.client() as c:
        # the revoke ended the streams, not the job
        assert c.get(f"/v1/jobs/{job['id']}").json()["state"] == "running"
        c.post(f"/v1/jobs/{job['id']}/cancel")
