"""GET /v1/jobs/{id} from memory, on both databases, never behind a commit for long.

The app runs in-process with its real change feed (PostgreSQL LISTEN/NOTIFY through the
triggers of migration 0002, or SQLite's data version); "elsewhere" is a second `Database`
with its own engine and connections, as a worker process has. The TTL is set far above every
wait here, so a change can only reach a GET through the feed or this process's own commits.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.testclient import TestClient
from sqlalchemy import event, text, update

from service.app import create_app
from service.auth.tokens import ensure_admin
from service.config import Settings
from service.db import Database
from service.jobs.cached_reads import job_list_json, job_view_json
from service.jobs.service import ListQuery
from service.jobs.view_cache import CachedView, ViewCache
from service.jobs.view_feed import install_commit_invalidation
from service.migrate import upgrade
from service.models import Job, JobAttempt, User
from service.testing.harness import wait_for
from tests.factories import make_job, set_job_state

TOKEN = "tj_view_cache_admin_token_0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TTL_S = 600.0  # no entry expires during a test: only the feed can refresh one
FEED_S = 10.0  # how long a commit elsewhere may take to reach the cache (it takes milliseconds)


@dataclass
class App:
    client: TestClient
    elsewhere: Database
    cache: ViewCache
    postgres: bool
    statements: list[str]

    def get(self, job_id: int, headers: dict[str, str] = AUTH) -> Any:
        return self.client.get(f"/v1/jobs/{job_id}", headers=headers)

    def seen_soon(self, job_id: int, check: Any) -> dict[str, Any]:
        """At once on SQLite (the data version is read before every look-up); on PostgreSQL
        once the NOTIFY is delivered."""
        if not self.postgres:
            body = self.get(job_id).json()
            assert check(body), body
            return body

        def changed() -> dict[str, Any] | None:
            body = self.get(job_id).json()
            return body if check(body) else None

        return wait_for(changed, FEED_S, "the change to reach the cache")


def make_settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    if request.param == "postgresql":
        url = request.getfixturevalue("pg_url")
    else:
        url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    return Settings(
        home=tmp_path,
        database_url=url,
        broker_url="filesystem://",
        admin_token=TOKEN,
        job_view_cache_ttl_s=TTL_S,
    )


@pytest.fixture(params=["postgresql", "sqlite"])
def app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[App]:
    settings = make_settings(request, tmp_path)
    upgrade(settings)
    with running_app(settings) as running:
        yield running


@contextmanager
def running_app(settings: Settings) -> Iterator[App]:
    api = create_app(settings, scheduler=False)
    elsewhere = Database(settings)
    with TestClient(api) as client:
        cache = api.state.view_cache
        statements: list[str] = []
        event.listen(api.state.db.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        postgres = api.state.db.is_postgres
        if postgres:
            wait_for(lambda: cache.enabled, FEED_S, "the change feed to listen")
        yield App(client, elsewhere, cache, postgres, statements)
    elsewhere.dispose()


def seed_job(db: Database, state: str = "running", owner: str = "admin") -> int:
    with db.transaction() as session:
        user = session.query(User).filter_by(name=owner).one()
        return make_job(session, user.id, state, name="cached").id


def settled_get(app: App, job_id: int) -> Any:
    """GET until the view stays cached: on PostgreSQL the NOTIFY of the seeding commit may
    arrive after the first GET and rightly drop what it stored (CI saw it once in ~1,000 runs)."""

    def stored() -> Any:
        answer = app.get(job_id)
        return answer if app.cache.view(job_id) is not None else None

    return wait_for(stored, FEED_S, "the job's view to stay cached")


def test_a_repeated_get_reads_no_database(app: App) -> None:
    job_id = seed_job(app.elsewhere)
    first = settled_get(app, job_id)
    app.statements.clear()
    hits = app.cache.hits
    second = app.get(job_id)
    assert second.status_code == 200 and second.content == first.content
    assert app.cache.hits == hits + 2  # the caller and the view
    assert app.statements == []
    assert second.json()["state"] == "running"
    scraped = app.client.get("/metrics", headers=AUTH).text
    assert "torchjobs_job_view_cache_enabled 1.0" in scraped
    assert f"torchjobs_job_view_cache_hits_total {float(app.cache.hits)}" in scraped


def test_a_commit_elsewhere_reaches_the_next_gets(app: App) -> None:
    job_id = seed_job(app.elsewhere)
    app.get(job_id)
    app.get(job_id)
    with app.elsewhere.transaction() as session:  # a worker's progress report
        session.execute(update(Job).where(Job.id == job_id).values(progress={"epoch": 3, "epochs": 9}))
    assert app.seen_soon(job_id, lambda b: b["progress"]["epoch"] == 3)
    with app.elsewhere.transaction() as session:  # a retry: a new attempt row only
        session.add(JobAttempt(job_id=job_id, attempt=2))
    app.seen_soon(job_id, lambda b: [a["attempt"] for a in b["attempts"]] == [1, 2])
    with app.elsewhere.transaction() as session:
        set_job_state(session, job_id, "succeeded")
    app.seen_soon(job_id, lambda b: b["state"] == "succeeded")


def test_this_process_reads_its_own_writes_at_once(app: App) -> None:
    job_id = seed_job(app.elsewhere)
    assert app.get(job_id).json()["state"] == "running"
    app.get(job_id)
    assert app.client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH).status_code == 202
    assert app.get(job_id).json()["state"] == "cancelling"


def test_a_revoked_token_is_refused_at_once(app: App) -> None:
    created = app.client.post("/v1/users", json={"name": "ann"}, headers=AUTH).json()
    ann = {"Authorization": f"Bearer {created['token']}"}
    job_id = seed_job(app.elsewhere, owner="ann")
    assert app.get(job_id, ann).status_code == 200
    assert app.get(job_id, ann).status_code == 200
    assert app.client.delete(f"/v1/users/{created['id']}/tokens", headers=AUTH).status_code == 204
    assert app.get(job_id, ann).status_code == 401


def test_a_token_revoked_elsewhere_is_refused(app: App) -> None:
    created = app.client.post("/v1/users", json={"name": "bob"}, headers=AUTH).json()
    bob = {"Authorization": f"Bearer {created['token']}"}
    job_id = seed_job(app.elsewhere, owner="bob")
    app.get(job_id, bob)
    assert app.get(job_id, bob).status_code == 200
    with app.elsewhere.transaction() as session:
        session.execute(update(User).where(User.id == created["id"]).values(token_hash=None))
    if app.postgres:
        wait_for(lambda: app.get(job_id, bob).status_code == 401, FEED_S, "the revocation")
    else:
        assert app.get(job_id, bob).status_code == 401


def test_a_cached_job_stays_hidden_from_other_users(app: App) -> None:
    created = app.client.post("/v1/users", json={"name": "eve"}, headers=AUTH).json()
    eve = {"Authorization": f"Bearer {created['token']}"}
    job_id = seed_job(app.elsewhere)
    own = seed_job(app.elsewhere, owner="eve")
    settled_get(app, job_id)
    assert app.get(own, eve).status_code == 200
    hits = app.cache.hits
    answer = app.get(job_id, eve)  # her caller and the admin's view, both from memory
    assert app.cache.hits == hits + 2
    assert answer.status_code == 404 and answer.json() == app.get(10**6, eve).json()
    assert app.get(job_id, {"Authorization": "Bearer tj_nobody"}).status_code == 401


def test_queued_jobs_are_read_every_time(app: App) -> None:
    """A queued job's position moves when others are placed: it is never cached."""
    first = seed_job(app.elsewhere, state="queued")
    second = seed_job(app.elsewhere, state="queued")
    assert app.get(second).json()["queue_position"] == 2
    with app.elsewhere.transaction() as session:
        set_job_state(session, first, "scheduled")
    assert app.get(second).json()["queue_position"] == 1


def listed(app: App, headers: dict[str, str] = AUTH) -> dict[int, dict[str, Any]]:
    page = app.client.get("/v1/jobs", headers=headers)
    assert page.status_code == 200, page.text
    return {item["id"]: item for item in page.json()["items"]}


def test_a_commit_elsewhere_reaches_the_list(app: App) -> None:
    """A page is assembled from the same cached views: it is exactly as fresh as a GET."""
    job_id = seed_job(app.elsewhere)
    settled_get(app, job_id)  # the seeding commit's NOTIFY is in: nothing else will drop it

    def from_memory() -> bool:
        listed(app)
        app.statements.clear()
        return listed(app)[job_id]["state"] == "running" and app.statements == []

    # the page's ids and its views from memory
    wait_for(from_memory, FEED_S, "a page read from memory")
    with app.elsewhere.transaction() as session:
        set_job_state(session, job_id, "succeeded")

    def changed() -> bool:
        return listed(app)[job_id]["state"] == "succeeded"

    if app.postgres:
        wait_for(changed, FEED_S, "the change to reach the list")
    else:
        assert changed()
    assert listed(app)[job_id] == app.get(job_id).json()


def test_a_job_created_elsewhere_reaches_the_list(app: App) -> None:
    """A page's ids are kept only until any job changes, a new one included: on PostgreSQL
    through the insert trigger alone (a submit writes the job row and its events only)."""
    first = seed_job(app.elsewhere)
    running = {"state": "running"}
    assert list(listed(app)) == [first]
    assert app.client.get("/v1/jobs", params=running, headers=AUTH).json()["items"][0]["id"] == first

    def from_memory() -> bool:
        """The page again with no statement (once the seed's own notice, which may arrive after
        the first read on a loaded machine, has been heard)."""
        app.statements.clear()
        return list(listed(app)) == [first] and app.statements == []

    wait_for(from_memory, FEED_S, "the page to be served from memory")
    with app.elsewhere.transaction() as session:
        admin = session.query(User).filter_by(name="admin").one()
        second = make_job(session, admin.id, "queued", attempt_row=False).id

    def both() -> bool:
        return list(listed(app)) == [second, first]

    if app.postgres:
        wait_for(both, FEED_S, "the new job to reach the list")
    else:
        assert both()
    with app.elsewhere.transaction() as session:
        set_job_state(session, first, "succeeded")

    def filtered() -> bool:
        return app.client.get("/v1/jobs", params=running, headers=AUTH).json()["items"] == []

    if app.postgres:
        wait_for(filtered, FEED_S, "the state change to reach the filtered list")
    else:
        assert filtered()


def test_a_listed_page_from_memory_shows_each_caller_their_own(app: App) -> None:
    created = app.client.post("/v1/users", json={"name": "liz"}, headers=AUTH).json()
    liz = {"Authorization": f"Bearer {created['token']}"}
    admins, hers = seed_job(app.elsewhere), seed_job(app.elsewhere, owner="liz")
    assert set(listed(app)) >= {admins, hers}  # both views now cached
    assert set(listed(app, liz)) == {hers}
    assert app.client.get("/v1/jobs", params={"parent": admins}, headers=liz).status_code == 404
    with app.elsewhere.transaction() as session:
        session.execute(update(User).where(User.id == created["id"]).values(token_hash=None))

    def refused() -> bool:
        return app.client.get("/v1/jobs", headers=liz).status_code == 401

    if app.postgres:
        wait_for(refused, FEED_S, "the revocation")
    else:
        assert refused()


def test_queued_jobs_in_a_list_are_read_every_time(app: App) -> None:
    first = seed_job(app.elsewhere, state="queued")
    second = seed_job(app.elsewhere, state="queued")
    assert listed(app)[second]["queue_position"] == 2
    with app.elsewhere.transaction() as session:
        set_job_state(session, first, "scheduled")
    assert listed(app)[second]["queue_position"] == 1


@pytest.fixture
def postgres_settings(pg_url: str, tmp_path: Path) -> Settings:
    settings = Settings(
        home=tmp_path,
        database_url=pg_url,
        broker_url="filesystem://",
        admin_token=TOKEN,
        job_view_cache_ttl_s=TTL_S,
    )
    upgrade(settings)
    return settings


def test_changes_made_while_the_feed_was_down_are_not_served(postgres_settings: Settings) -> None:
    with running_app(postgres_settings) as app:
        job_id = seed_job(app.elsewhere)
        app.get(job_id)
        with app.elsewhere.transaction() as session:
            # kill the API's LISTEN connection (this database's only: other test processes'
            # stacks listen too), then commit before it is back
            session.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE query LIKE 'LISTEN %' AND datname = current_database()"
                )
            )
        with app.elsewhere.transaction() as session:
            set_job_state(session, job_id, "failed")
        wait_for(lambda: app.get(job_id).json()["state"] == "failed", FEED_S, "the change")
        wait_for(lambda: app.cache.enabled, FEED_S, "the feed to listen again")
        settled_get(app, job_id)
        hits = app.cache.hits
        app.get(job_id)
        assert app.cache.hits == hits + 2  # back in use


def test_without_its_triggers_the_cache_stays_off(postgres_settings: Settings) -> None:
    elsewhere = Database(postgres_settings)
    with elsewhere.transaction() as session:
        session.execute(text("DROP TRIGGER torchjobs_view_jobs ON jobs"))
    elsewhere.dispose()
    with running_app_unwaited(postgres_settings) as app:
        job_id = seed_job(app.elsewhere)
        for _ in range(3):
            assert app.get(job_id).status_code == 200
        assert app.cache.hits == 0 and not app.cache.enabled
        assert "torchjobs_job_view_cache_enabled 0.0" in app.client.get("/metrics", headers=AUTH).text


@contextmanager
def running_app_unwaited(settings: Settings) -> Iterator[App]:
    api = create_app(settings, scheduler=False)
    elsewhere = Database(settings)
    with TestClient(api) as client:
        yield App(client, elsewhere, api.state.view_cache, True, [])
    elsewhere.dispose()


def test_this_process_commits_clear_the_cache_only_when_they_wrote(tmp_path: Path) -> None:
    """Its own commits do not wait for the feed: a client reads its own write next request."""
    settings = Settings(home=tmp_path, admin_token=TOKEN)
    upgrade(settings)
    db = Database(settings)
    with db.transaction() as session:
        ensure_admin(session, settings)
    cache = ViewCache(ttl_s=TTL_S)
    cache.enable()
    install_commit_invalidation(db.sessionmaker, cache)
    job_id = seed_job(db)
    assert cache.view(job_id) is None

    def primed() -> ViewCache:
        cache.store_view(job_id, CachedView(owner_id=1, body=b"{}"), cache.generation)
        return cache

    primed()
    with db.transaction() as session:  # a read-only pass, like an idle scheduler tick
        session.get(Job, job_id)
        session.execute(text("SELECT 1"))  # (its advisory lock, on PostgreSQL)
    assert cache.view(job_id) is not None

    def failed_then_rolled_back() -> None:
        with db.transaction() as session:
            set_job_state(session, job_id, "failed")
            raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError, match="rolled back"):
        failed_then_rolled_back()
    assert cache.view(job_id) is not None
    with db.transaction() as session:
        set_job_state(session, job_id, "failed")
    assert cache.view(job_id) is None
    primed()
    with db.transaction() as session:
        session.get(Job, job_id).name = "renamed"  # an ORM flush
    assert cache.view(job_id) is None
    primed()
    with db.transaction() as session:
        session.execute(text("UPDATE jobs SET name = 'again' WHERE id = :id"), {"id": job_id})
    assert cache.view(job_id) is None
    db.dispose()


def test_clients_that_miss_together_share_one_read(tmp_path: Path) -> None:
    """After an invalidation every polling client misses at once: one read answers them all,
    unless a change came in between (then the later ones read again)."""
    settings = Settings(home=tmp_path, admin_token=TOKEN)
    upgrade(settings)
    db = Database(settings)
    with db.transaction() as session:
        ensure_admin(session, settings)
    job_id = seed_job(db)
    cache = ViewCache(ttl_s=TTL_S)
    cache.enable()
    creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=TOKEN)
    reads: list[str] = []
    event.listen(
        db.engine,
        "before_cursor_execute",
        lambda *a: reads.append(a[2]) if a[2].startswith("SELECT") else None,
    )

    async def together(n: int, change_midway: bool = False) -> list[bytes]:
        first = [asyncio.ensure_future(job_view_json(db, cache, creds, job_id)) for _ in range(n)]
        if change_midway:
            await asyncio.sleep(0)  # the first ones are in flight
            cache.invalidate_job(job_id)
        later = [asyncio.ensure_future(job_view_json(db, cache, creds, job_id)) for _ in range(n)]
        return await asyncio.gather(*first, *later)

    bodies = asyncio.run(together(10))
    assert len(set(bodies)) == 1 and json.loads(bodies[0])["id"] == job_id
    one_read = len(reads)
    assert 0 < one_read <= 5, reads
    cache.invalidate_all()
    reads.clear()
    asyncio.run(together(10, change_midway=True))
    assert len(reads) == 2 * one_read, reads
    db.dispose()


def test_pages_that_miss_the_same_jobs_share_one_render(tmp_path: Path) -> None:
    """A running job on the newest page is invalidated at every progress report: the pages
    listed at that moment read and render it once between them."""
    settings = Settings(home=tmp_path, admin_token=TOKEN)
    upgrade(settings)
    db = Database(settings)
    with db.transaction() as session:
        ensure_admin(session, settings)
    job_ids = [seed_job(db) for _ in range(3)]
    cache = ViewCache(ttl_s=TTL_S)
    cache.enable()
    creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=TOKEN)
    renders: list[str] = []
    event.listen(
        db.engine,
        "before_cursor_execute",
        lambda *a: renders.append(a[2]) if "FROM jobs \nWHERE jobs.id IN" in a[2] else None,
    )

    async def together(n: int) -> list[bytes]:
        pages = [asyncio.ensure_future(job_list_json(db, cache, creds, ListQuery())) for _ in range(n)]
        return await asyncio.gather(*pages)

    first = asyncio.run(together(1))[0]
    assert [item["id"] for item in json.loads(first)["items"]] == job_ids[::-1]
    assert len(renders) == 1
    cache.invalidate_job(job_ids[1])
    renders.clear()
    assert set(asyncio.run(together(10))) == {first}
    assert len(renders) == 1, renders
    db.dispose()
