"""The job routes' SQL per request: a fixed handful, whatever the page size, and no transaction
round trips for a read on PostgreSQL (service.db `read_sessionmaker` runs in autocommit)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from service.app import create_app
from service.config import Settings
from service.jobs.schemas import JobList
from service.migrate import upgrade
from service.models import User
from tests.factories import make_job, make_node_run, move_job

TOKEN = "tj_request_queries_token_0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC = {
    "name": "q",
    "mode": "single",
    "gpus_per_node": 1,
    "entrypoint": {"kind": "builtin", "model": "cnn", "dataset": "digits"},
}


class Statements:
    """Every statement the app's engine sends, BEGIN and COMMIT included when the driver sends them."""

    def __init__(self) -> None:
        self.sql: list[str] = []

    def clear(self) -> None:
        self.sql.clear()

    def count(self, prefix: str) -> int:
        return sum(1 for s in self.sql if s.lstrip().upper().startswith(prefix))


@pytest.fixture
def client(pg_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Statements]]:
    # a TTL no loaded machine outlasts: the counts are about what is cached, not for how long
    # (5 s passed between two requests of a test once, with the suite on both cores)
    settings = Settings(
        home=tmp_path,
        database_url=pg_url,
        broker_url="filesystem://",
        admin_token=TOKEN,
        job_view_cache_ttl_s=300,
    )
    upgrade(settings)
    app = create_app(settings, scheduler=False)
    seen = Statements()
    with TestClient(app) as c:
        engine = app.state.db.engine

        @event.listens_for(engine, "before_cursor_execute")
        def _statement(_conn, _cursor, statement, _params, _context, _many) -> None:  # type: ignore[no-untyped-def]
            seen.sql.append(statement)

        # psycopg sends BEGIN and COMMIT itself, except on a connection in autocommit
        @event.listens_for(engine, "begin")
        def _begin(conn) -> None:  # type: ignore[no-untyped-def]
            if not conn.connection.dbapi_connection.autocommit:
                seen.sql.append("BEGIN")

        @event.listens_for(engine, "commit")
        def _commit(conn) -> None:  # type: ignore[no-untyped-def]
            if not conn.connection.dbapi_connection.autocommit:
                seen.sql.append("COMMIT")

        yield c, seen


def _finished_jobs(client: TestClient, n: int) -> list[int]:
    """`n` succeeded jobs of the admin, each with its attempt and node run."""
    db = client.app.state.db  # type: ignore[attr-defined]
    ids = []
    with db.transaction() as session:
        admin = session.query(User).filter_by(name="admin").one()
        for i in range(n):
            job = make_job(session, admin.id, name=f"done-{i}", exit_code=0)
            make_node_run(session, job, "succeeded", address="a")
            move_job(session, job, "succeeded")
            ids.append(job.id)
    return ids


def test_get_job_is_five_reads_and_no_transaction(client: tuple[TestClient, Statements]) -> None:
    c, seen = client
    [job_id] = _finished_jobs(c, 1)
    seen.clear()
    body = c.get(f"/v1/jobs/{job_id}", headers=AUTH).json()
    # caller, job, node runs, attempts, latest checkpoint; the owner's name is the caller's
    assert len(seen.sql) == 5, seen.sql
    assert seen.count("BEGIN") == seen.count("COMMIT") == 0
    assert body["owner"] == "admin"
    assert body["assignments"] == [{"node_rank": 0, "worker": "w", "gpus": [0]}]
    assert [a["attempt"] for a in body["attempts"]] == [1]


def test_list_costs_the_same_statements_for_any_page_size(client: tuple[TestClient, Statements]) -> None:
    c, seen = client
    _finished_jobs(c, 30)
    cache = c.app.state.view_cache  # type: ignore[attr-defined]
    counts = []
    for limit in (2, 30):
        cache.invalidate_all()  # every job rendered afresh
        seen.clear()
        page = c.get("/v1/jobs", params={"limit": limit}, headers=AUTH).json()
        assert len(page["items"]) == limit
        assert all(item["assignments"] for item in page["items"])
        counts.append(len(seen.sql))
    # caller, the page's ids, the jobs, node runs, attempts, latest checkpoints
    assert counts[0] == counts[1] == 6, counts


def test_a_page_of_rendered_jobs_is_one_query(client: tuple[TestClient, Statements]) -> None:
    """The views the first read rendered are the page's next time: the ids, and nothing else;
    and while no job changes, not even those."""
    c, seen = client
    _finished_jobs(c, 30)
    first = c.get("/v1/jobs", params={"limit": 30}, headers=AUTH)
    c.app.state.view_cache._pages.clear()  # type: ignore[attr-defined]  # the ids forgotten
    seen.clear()
    again = c.get("/v1/jobs", params={"limit": 30}, headers=AUTH)
    assert len(seen.sql) == 1 and "FROM jobs" in seen.sql[0], seen.sql
    assert again.content == first.content
    seen.clear()
    assert c.get("/v1/jobs", params={"limit": 30}, headers=AUTH).content == first.content
    assert seen.sql == []
    # the bytes pydantic itself writes for that page
    assert JobList.model_validate_json(first.content).model_dump_json().encode() == first.content


def test_submit_takes_no_savepoint_without_an_idempotency_key(client: tuple[TestClient, Statements]) -> None:
    c, seen = client
    seen.clear()
    first = c.post("/v1/jobs", json=SPEC, headers=AUTH)
    assert first.status_code == 201
    assert seen.count("SAVEPOINT") == 0
    assert seen.count("BEGIN") == seen.count("COMMIT") == 1
    keyed = {**AUTH, "Idempotency-Key": "k1"}
    again = [c.post("/v1/jobs", json=SPEC, headers=keyed) for _ in range(2)]
    assert [r.status_code for r in again] == [201, 200]
    assert again[0].json()["id"] == again[1].json()["id"] != first.json()["id"]
    assert c.get(f"/v1/jobs/{first.json()['id']}", headers=AUTH).json()["state"] == "queued"


def test_submit_is_one_statement_once_the_caller_and_the_hosts_are_known(
    client: tuple[TestClient, Statements],
) -> None:
    """The job, its first event, its webhook deliveries and its queue position: one statement
    (#42; eight round trips before: caller, hosts, job, event, outbox, position, BEGIN, COMMIT).
    The first submit of a token reads the caller, and the first of the process the hosts."""
    c, seen = client
    seen.clear()
    first = c.post("/v1/jobs", json=SPEC, headers=AUTH)
    assert first.status_code == 201 and first.json()["queue_position"] == 1
    # caller, the hosts' version, the hosts, the job
    assert len(seen.sql) == 6 and seen.count("BEGIN") == seen.count("COMMIT") == 1, seen.sql
    seen.clear()
    again = c.post("/v1/jobs", json=SPEC, headers=AUTH)
    assert again.status_code == 201 and again.json()["queue_position"] == 2
    assert len(seen.sql) == 3 and seen.count("BEGIN") == seen.count("COMMIT") == 1, seen.sql
    assert seen.count("WITH") == 1
    assert c.get(f"/v1/jobs/{again.json()['id']}", headers=AUTH).json()["queue_position"] == 2
