"""Every string field of the job spec, user names and upload names, with what a database or an
encoder chokes on: `422` or `201`, never a 5xx, on SQLite and on PostgreSQL (contract §7).

PostgreSQL refuses a NUL in text and no encoder takes a lone surrogate: before, both were a
500 (each on its own database). The bodies are sent as a hostile client would, JSON with the
escapes as they are (`\\u0000`, `\\ud800`), not through a client library that would refuse them.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.testing import harness
from service.testing.harness import Stack

NASTY = {
    "nul": "a\x00b",
    "surrogate": "a\ud800b",
    "100kB": "x" * 100_000,
    "rtl": "\u202eevil\u202c\u2067txt\u2069",
}
BAD = ("nul", "surrogate")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An API server and its database, no worker: submitted jobs are judged and then wait."""
    home = Path(tmp_path_factory.mktemp(f"strings-{request.param}"))
    pg = harness.create_pg_database(migrated=True) if request.param == "postgresql" else None
    env = harness.make_env(home, **({"TORCHJOBS_DATABASE_URL": pg} if pg else {}))
    subprocess.run(harness.torchjobs_cmd("db", "upgrade"), env=env, check=True, capture_output=True)
    stack = Stack(home=home, env=env, port=harness.free_port(), embedded=False)
    stack.start_server()
    yield stack
    stack.stop()
    if pg:
        harness.drop_pg_database(pg)


def _with(path: tuple[Any, ...], value: str) -> dict[str, Any]:
    """A valid spec with `value` put at `path` (a key of the last map when it ends in KEY)."""
    spec: dict[str, Any] = {
        "name": "ok",
        "mode": "single",
        "entrypoint": {"kind": "script", "path": "hello.py", "args": ["a"]},
        "env": {"A": "1"},
        "labels": {"team": "x"},
    }
    if path[0] == "factory":
        spec["entrypoint"] = {"kind": "factory", "model": "m:f", "dataset": "m:g"}
        path = ("entrypoint", *path[1:])
    target = spec
    for part in path[:-1]:
        target = target[part]
    last = path[-1]
    if last == "KEY":
        target[value] = "v"
    else:
        target[last] = value
    return spec


FIELDS = [
    ("name",),
    ("entrypoint", "path"),
    ("entrypoint", "args", 0),
    ("factory", "model"),
    ("factory", "dataset"),
    ("env", "A"),
    ("env", "KEY"),
    ("labels", "team"),
    ("labels", "KEY"),
]


def _post(stack: Stack, path: str, body: Any) -> int:
    with stack.client() as c:
        raw = json.dumps(body).encode()  # ensure_ascii: a surrogate travels as its escape
        return c.post(path, content=raw, headers={"Content-Type": "application/json"}).status_code


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: ".".join(map(str, f)))
def test_every_spec_string_field_refuses_what_cannot_be_stored(server: Stack, field: tuple) -> None:
    for kind, value in NASTY.items():
        status = _post(server, "/v1/jobs", _with(field, value))
        assert status < 500, f"{kind} in {field}: {status}"
        if kind in BAD:
            assert status == 422, f"{kind} in {field}: {status}"
    with server.client() as c:  # and whatever was stored renders
        assert c.get("/v1/jobs", params={"limit": 500}).status_code == 200


def test_a_refused_string_names_its_field(server: Stack) -> None:
    with server.client() as c:
        raw = json.dumps(_with(("labels", "team"), "a\ud800")).encode()
        resp = c.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 422
    detail = resp.json()["detail"][0]
    assert detail["loc"][:2] == ["body", "labels"] and "unicode" in detail["msg"].lower()


def test_user_and_upload_names(server: Stack) -> None:
    for kind, value in NASTY.items():
        status = _post(server, "/v1/users", {"name": value})
        assert status in (201, 422), f"user name {kind}: {status}"
        assert kind not in BAD or status == 422
    with server.client() as c:
        for raw_name in ("a%00b", "a%ED%A0%80b", "x" * 300, "%E2%80%AEevil"):
            resp = c.post(
                f"/v1/checkpoints?name={raw_name}",
                content=b"not a checkpoint",
                headers={"Content-Type": "application/octet-stream"},
            )
            assert resp.status_code in (201, 422), f"upload name {raw_name[:20]}: {resp.status_code}"
        octets = {"Content-Type": "application/octet-stream"}
        nul = c.post("/v1/checkpoints?name=a%00b", content=b"x", headers=octets)
        assert nul.status_code == 422 and nul.json()["detail"][0]["loc"] == ["query", "name"]
        assert c.get("/v1/jobs").status_code == 200
