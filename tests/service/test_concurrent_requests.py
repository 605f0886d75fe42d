"""Many clients at once against a real server: every request is answered, none waits for ever.

Before request sessions took a slot first, 100 clients on GET /v1/jobs/{id} deadlocked the
server: all 40 threads waited for a pooled connection while every connection belonged to a
request waiting for a thread; answers stopped until the pool's 30 s timeout made them 500s.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from service.testing import harness

CLIENTS = 150  # more than the thread pool (40) and the connection pool (30) together
ROUNDS = 3
SPEC = {
    "name": "many-clients",
    "mode": "single",
    "gpus_per_node": 1,
    "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "digits"},
    "hyperparameters": {"epochs": 1},
}


async def _status(client: httpx.AsyncClient, path: str) -> int | str:
    """The status, or the transport error's name. A connection reset is retried once, as HTTP
    clients do for an idempotent GET (seen once in 10 runs here, never twice in a row); a
    deadlocked server fails either way: its answers are 500s after the pool's timeout."""
    for attempt in range(2):
        try:
            return (await client.get(path)).status_code
        except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
            if attempt == 1:
                return f"{type(exc).__name__}: {exc}"
        except httpx.TransportError as exc:
            return f"{type(exc).__name__}: {exc}"
    raise AssertionError("unreachable")


async def _hammer(stack: harness.Stack, path: str) -> Counter[int | str]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    headers = {"Authorization": f"Bearer {harness.ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=stack.url, headers=headers, limits=limits, timeout=120) as client:

        async def one_client() -> list[int | str]:
            return [await _status(client, path) for _ in range(ROUNDS)]

        results = await asyncio.gather(*(one_client() for _ in range(CLIENTS)))
    return Counter(code for codes in results for code in codes)


@pytest.mark.parametrize("setup", ["embedded", "production"])
def test_more_clients_than_threads_and_connections_all_get_answers(
    setup: str, request: pytest.FixtureRequest
) -> None:
    stack: harness.Stack = request.getfixturevalue(setup)
    job = stack.submit(SPEC)
    codes = asyncio.run(_hammer(stack, f"/v1/jobs/{job['id']}"))
    assert codes == Counter({200: CLIENTS * ROUNDS})
    codes = asyncio.run(_hammer(stack, "/v1/jobs?limit=5"))
    assert codes == Counter({200: CLIENTS * ROUNDS})
    assert stack.wait_job(job["id"])["state"] == "succeeded"
