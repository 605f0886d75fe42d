"""Issue 8: closed by default, isolation between users, hostile input — against a real server.

The stack here has no worker, so nothing a test submits ever runs: a spec is judged by the
API alone. Its script root is a temporary folder holding a good script and traps.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.testing import harness
from service.testing.harness import Stack

OPEN_PATHS = {"/healthz"}


def every_operation() -> list[tuple[str, str]]:
    """Every route of the app, from its own schema, so a new route cannot be forgotten."""
    schema = create_app(Settings(admin_token="x")).openapi()
    ops = [(m.upper(), p) for p, item in schema["paths"].items() for m in item if p not in OPEN_PATHS]
    return sorted(ops) + [("GET", "/openapi.json")]


def concrete(path: str) -> str:
    return (
        path.replace("{job_id}", "1")
        .replace("{user_id}", "2")
        .replace("{checkpoint_id}", "1")
        .replace("{ckpt_id}", "1")
    )


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("roots")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "ok.py").write_text("print('ok')\n")
    (outside / "evil.py").write_text("print('evil')\n")
    (root / "link.py").symlink_to(outside / "evil.py")
    (root / "dirlink").symlink_to(outside)
    return root, outside


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, module_pg_url: str, roots: tuple[Path, Path]
) -> Iterator[Stack]:
    home = Path(tmp_path_factory.mktemp("security"))
    env = harness.make_env(home, TORCHJOBS_DATABASE_URL=module_pg_url, TORCHJOBS_SCRIPT_ROOTS=str(roots[0]))
    import subprocess

    subprocess.run(harness.torchjobs_cmd("db", "upgrade"), env=env, check=True, capture_output=True)
    s = Stack(home=home, env=env, port=harness.free_port(), embedded=False)
    s.start_server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def users(stack: Stack) -> dict[str, str]:
    tokens = {}
    with stack.client() as c:
        for name in ("alice", "bob", "mallory"):
            resp = c.post("/v1/users", json={"name": name})
            assert resp.status_code == 201
            tokens[name] = resp.json()["token"]
            tokens[f"{name}_id"] = resp.json()["id"]
        assert c.delete(f"/v1/users/{tokens['mallory_id']}/tokens").status_code == 204
    return tokens


@pytest.mark.parametrize(("method", "path"), every_operation())
@pytest.mark.parametrize("who", ["none", "wrong", "revoked"])
def test_every_route_refuses_missing_wrong_and_revoked_tokens(
    stack: Stack, users: dict[str, str], method: str, path: str, who: str
) -> None:
    headers = {
        "none": {},
        "wrong": {"Authorization": "Bearer tj_wrong"},
        "revoked": {"Authorization": f"Bearer {users['mallory']}"},
    }[who]
    resp = httpx.request(method, f"{stack.url}{concrete(path)}", headers=headers, timeout=10)
    assert resp.status_code == 401, resp.text
    assert resp.json() == {"detail": "missing or invalid bearer token"}


@pytest.mark.parametrize(("method", "path"), [op for op in every_operation() if "{" in op[1]])
def test_a_missing_token_is_401_even_on_a_malformed_path(stack: Stack, method: str, path: str) -> None:
    """Authentication comes first on every route: no token means 401 whatever the id."""
    malformed = re.sub(r"\{[a-z_]+\}", "not-a-number", path)
    resp = httpx.request(method, f"{stack.url}{malformed}", timeout=10)
    assert resp.status_code == 401, resp.text


INTEGER_IDS = re.compile(r"\{(job_id|user_id|ckpt_id|checkpoint_id|webhook_id)\}")


@pytest.mark.parametrize(("method", "path"), [op for op in every_operation() if INTEGER_IDS.search(op[1])])
def test_an_id_no_row_can_have_is_a_404_and_a_word_a_422(stack: Stack, method: str, path: str) -> None:
    """Contract §2: unknown is a 404, also for 0, -1 and ids past the column's range (answered
    without a query: PostgreSQL would refuse 2**70 as a parameter)."""
    with stack.client() as c:
        for unknown in ("0", "-1", str(2**31), str(2**70)):
            resp = c.request(method, INTEGER_IDS.sub(unknown, path))
            assert resp.status_code == 404, (unknown, resp.text)
            assert resp.json()["detail"].endswith("not found")
        assert c.request(method, INTEGER_IDS.sub("abc", path)).status_code == 422


def test_me_and_admin_only_user_creation(stack: Stack, users: dict[str, str]) -> None:
    with stack.client(users["alice"]) as c:
        me = c.get("/v1/me").json()
        assert me["name"] == "alice" and me["is_admin"] is False
        assert c.post("/v1/users", json={"name": "eve"}).status_code == 403
    with stack.client() as c:
        assert c.post("/v1/users", json={"name": "alice"}).status_code == 409
        assert c.get("/v1/me").json()["is_admin"] is True


def test_users_never_see_each_others_jobs(stack: Stack, users: dict[str, str]) -> None:
    spec = {"mode": "single", "entrypoint": {"kind": "script", "path": "ok.py"}}
    with stack.client(users["alice"]) as alice, stack.client(users["bob"]) as bob, stack.client() as admin:
        job = alice.post("/v1/jobs", json=spec).json()
        missing = 10**9
        for suffix in ("", "/events", "/metrics", "/checkpoints", "/logs", "/events/stream", "/logs/stream"):
            theirs = bob.get(f"/v1/jobs/{job['id']}{suffix}")
            unknown = bob.get(f"/v1/jobs/{missing}{suffix}")
            assert theirs.status_code == unknown.status_code == 404, suffix
            assert theirs.json() == unknown.json()
        assert bob.post(f"/v1/jobs/{job['id']}/cancel").status_code == 404
        assert job["id"] not in [j["id"] for j in bob.get("/v1/jobs").json()["items"]]
        assert job["id"] in [j["id"] for j in alice.get("/v1/jobs").json()["items"]]
        assert job["id"] in [j["id"] for j in admin.get("/v1/jobs", params={"limit": 500}).json()["items"]]
        resume = bob.post("/v1/jobs", json={**spec, "resume_from": {"job_id": job["id"]}})
        assert resume.status_code == 422
        assert alice.get(f"/v1/jobs/{job['id']}").json()["state"] == "queued"


@pytest.mark.parametrize(
    "path",
    [
        "../outside/evil.py",
        "link.py",
        "dirlink/evil.py",
        "/etc/passwd",
        "missing.py",
        "/",
        "ok.py/../../outside/evil.py",
    ],
)
def test_scripts_outside_the_roots_are_422_and_nothing_is_written(stack: Stack, roots, path: str) -> None:
    with stack.client() as c:
        before = [j["id"] for j in c.get("/v1/jobs", params={"limit": 1}).json()["items"]]
        resp = c.post("/v1/jobs", json={"mode": "single", "entrypoint": {"kind": "script", "path": path}})
        after = [j["id"] for j in c.get("/v1/jobs", params={"limit": 1}).json()["items"]]
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "entrypoint", "path"]
    assert str(roots[1]) not in resp.text  # no filesystem paths leak
    assert before == after


def test_absolute_path_inside_the_root_is_fine(stack: Stack, roots) -> None:
    with stack.client() as c:
        resp = c.post(
            "/v1/jobs",
            json={"mode": "single", "entrypoint": {"kind": "script", "path": str(roots[0] / "ok.py")}},
        )
    assert resp.status_code == 201


def raw_post(stack: Stack, head: bytes, body_chunks: list[bytes]) -> bytes:
    with socket.create_connection(("127.0.0.1", stack.port), timeout=10) as sock:
        sock.sendall(head)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return sock.recv(65536)


def test_a_100mb_body_is_413_before_it_is_read(stack: Stack) -> None:
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {harness.ADMIN_TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {100 * 1024 * 1024}\r\n\r\n"
    ).encode()
    reply = raw_post(stack, head, [b"{" + b" " * 1024])  # we send 1 KiB of the promised 100 MB
    assert reply.startswith(b"HTTP/1.1 413")


def test_a_chunked_body_past_the_limit_is_413(stack: Stack) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(3):
            yield b" " * (1024 * 1024)

    with stack.client() as c:
        resp = c.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "3"},
        {"MASTER_ADDR": "evil"},
        {"LOCAL_RANK": "0"},
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"TORCHJOBS_X": "1"},
        {"LD_PRELOAD": "/tmp/x.so"},
        {"PYTHONPATH": "/tmp"},
        {"WORLD_SIZE": "1"},
        {"bad-name": "1"},
    ],
)
def test_reserved_environment_is_refused(stack: Stack, env: dict[str, str]) -> None:
    with stack.client() as c:
        resp = c.post("/v1/jobs", json={"mode": "single", "entrypoint": {"kind": "builtin"}, "env": env})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"][:2] == ["body", "env"]


def test_errors_never_leak_internals(stack: Stack) -> None:
    with stack.client() as c:
        for resp in (
            c.get("/v1/jobs/abc"),
            c.get("/v1/jobs", params={"cursor": "'; DROP TABLE jobs; --"}),
            c.get("/v1/jobs", params={"state": "nope"}),
            c.post("/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"}),
            c.get(f"/v1/jobs/{2**70}"),
        ):
            assert resp.status_code in (404, 422), resp.text
            text = resp.text.lower()
            assert "traceback" not in text and "sqlalchemy" not in text and "/work/" not in text


def test_idempotency_key_returns_the_first_job_never_a_second(stack: Stack, users: dict[str, str]) -> None:
    spec = {"mode": "single", "entrypoint": {"kind": "script", "path": "ok.py"}}
    with stack.client(users["alice"]) as alice, stack.client(users["bob"]) as bob:
        first = alice.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "k-1"})
        again = alice.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "k-1"})
        other_user = bob.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "k-1"})
        assert (first.status_code, again.status_code, other_user.status_code) == (201, 200, 201)
        assert again.json()["id"] == first.json()["id"] != other_user.json()["id"]
        assert first.headers["Location"] == f"/v1/jobs/{first.json()['id']}" == again.headers["Location"]
        mine = [j["id"] for j in alice.get("/v1/jobs", params={"limit": 500}).json()["items"]]
        assert mine.count(first.json()["id"]) == 1


def test_list_pages_newest_first_with_a_cursor_and_filters_by_state(
    stack: Stack, users: dict[str, str]
) -> None:
    spec = {"mode": "single", "entrypoint": {"kind": "script", "path": "ok.py"}}
    with stack.client(users["bob"]) as bob:
        made = [bob.post("/v1/jobs", json=spec).json()["id"] for _ in range(5)]
        seen, cursor = [], None
        while True:
            page = bob.get("/v1/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
            seen += [j["id"] for j in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == sorted(seen, reverse=True) and set(made) <= set(seen) and len(seen) == len(set(seen))
        queued = bob.get("/v1/jobs", params={"state": "queued", "limit": 500}).json()["items"]
        assert {j["state"] for j in queued} == {"queued"}
        assert bob.get("/v1/jobs", params={"state": "sleeping"}).status_code == 422
        assert bob.get("/v1/jobs", params={"limit": 0}).status_code == 422


def _page(page: dict) -> tuple[list[int], dict]:
    """The jobs a page lists and its cursor; not each job's fields, which a scheduler pass may
    change between two reads (`pending_reason` went from "waiting for the scheduler" to "no
    worker is online" between the two GETs once in CI)."""
    return [j["id"] for j in page["items"]], {k: v for k, v in page.items() if k != "items"}


def test_an_empty_query_value_is_the_parameter_left_out(stack: Stack, users: dict[str, str]) -> None:
    """The contract writes `?state=&limit=&cursor=` and `?...&attempt=`: taken literally, each
    empty value means its default, not a 422."""
    spec = {"mode": "single", "entrypoint": {"kind": "script", "path": "ok.py"}}
    with stack.client(users["bob"]) as bob:
        job = bob.post("/v1/jobs", json=spec).json()["id"]
        everything = _page(bob.get("/v1/jobs", params={"limit": 50}).json())
        assert _page(bob.get("/v1/jobs?state=&limit=&cursor=&parent=").json()) == everything
        events = bob.get(f"/v1/jobs/{job}/events").json()
        assert bob.get(f"/v1/jobs/{job}/events?after=&limit=").json() == events
        logs = bob.get(f"/v1/jobs/{job}/logs?node=&rank=&offset=&attempt=")
        plain = bob.get(f"/v1/jobs/{job}/logs")
        assert (logs.status_code, logs.text) == (plain.status_code, plain.text) and logs.status_code < 500
        assert bob.get("/v1/usage?user=&since=&until=").status_code == 200
        assert bob.get("/v1/jobs?limit=0").status_code == 422  # a value that is there is still checked
