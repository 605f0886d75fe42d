"""`GET /v1/jobs/{id}` from the job-view cache when it can, from the database when it must.

A hit runs on the event loop and touches no connection: the token is hashed, the caller and
the rendered view are looked up, and the caller's right to see the job is checked exactly as
the database read checks it (an admin sees every job; anyone else only their own, and a job
that is not theirs is a 404, as if it did not exist). A miss reads both in one thread-pool hop
and stores what it read, unless something changed while it was reading.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

from fastapi.security import HTTPAuthorizationCredentials
from starlette.concurrency import run_in_threadpool

from service.api.deps import current_user
from service.auth.tokens import hash_token, presented_token
from service.db import Database
from service.errors import NotFound
from service.jobs import repository as repo
from service.jobs import service
from service.jobs.service import ListQuery
from service.jobs.states import QUEUED
from service.jobs.view_cache import CachedCaller, CachedView, PageKey, ViewCache

Read = tuple[CachedCaller | None, CachedView | None]
T = TypeVar("T")


async def job_view_json(
    db: Database, cache: ViewCache, creds: HTTPAuthorizationCredentials | None, job_id: int
) -> bytes:
    token_hash = hash_token(presented_token(creds))
    cache.refresh()
    caller = cache.caller(token_hash)
    cached = cache.view(job_id) if caller is not None else None
    if caller is not None and cached is not None:
        if not caller.is_admin and cached.owner_id != caller.user_id:
            raise NotFound("job")
        return cached.body
    generation, read = _shared_read(db, cache, creds, token_hash, job_id)
    caller, view = await asyncio.shield(read)
    if caller is not None:
        cache.store_caller(token_hash, caller, generation)
    if view is None:
        raise NotFound("job")
    cache.store_view(job_id, view, generation)
    return view.body


def _shared_read(
    db: Database,
    cache: ViewCache,
    creds: HTTPAuthorizationCredentials | None,
    token_hash: str,
    job_id: int,
) -> tuple[int, asyncio.Future[Read]]:
    """One database read for every miss of the same caller and job while nothing changed.

    A change invalidates a job that every client is polling: without this, each client in
    flight missed at once and read it again (measured: 32 clients, 5 progress updates a
    second, most of the server's CPU spent re-reading one job). A request joins a read only
    if no invalidation came between that read's start and its own arrival, so it never gets
    an answer older than a change it could have seen. The read is its own task: a client
    that goes away does not cancel it for the others."""
    return shared_flight(
        cache,
        cache.reads_in_flight,
        (token_hash, job_id),
        lambda _generation: run_in_threadpool(_read, db, creds, job_id),
    )


def shared_flight(
    cache: ViewCache,
    flights: dict[Any, tuple[int, Any]],
    key: Hashable,
    start: Callable[[int], Awaitable[T]],
) -> tuple[int, asyncio.Future[T]]:
    """(generation, future) of the work under way for `key` if nothing was invalidated since
    it began, else of a new one, `start(generation)`, registered until it lands. The future
    is its own task: a client that goes away does not cancel it for the others."""
    generation = cache.generation
    flight = flights.get(key)
    if cache.enabled and flight is not None and flight[0] == generation:
        return flight  # (with the cache off no change is signalled: nothing is shared)
    future: asyncio.Future[T] = asyncio.ensure_future(start(generation))
    flights[key] = entry = (generation, future)

    def landed(done: asyncio.Future[T]) -> None:
        if flights.get(key) is entry:
            del flights[key]
        if not done.cancelled():
            done.exception()  # retrieved here, so an error nobody awaited is not logged as lost

    future.add_done_callback(landed)
    return entry


def _read(db: Database, creds: HTTPAuthorizationCredentials | None, job_id: int) -> Read:
    """The caller and, when they may see it, the job's rendered view; queued jobs' views are
    returned but marked unstorable by their state (their queue position moves with others)."""
    with db.read() as session:
        user = current_user(session, creds)
        caller = CachedCaller(user_id=user.id, is_admin=user.is_admin, name=user.name)
        try:
            job = service.get_job(session, user, job_id)
        except NotFound:
            return caller, None
        view = service.job_views(session, [job], viewer=user)[0]
    body = view.model_dump_json().encode()
    return caller, CachedView(owner_id=job.owner_id, body=body, storable=job.state != QUEUED)


async def job_list_json(
    db: Database, cache: ViewCache, creds: HTTPAuthorizationCredentials | None, query: ListQuery
) -> bytes:
    """A page of `GET /v1/jobs` assembled from the same rendered views: one query for the
    page's ids, and only the jobs the cache does not hold are read and rendered (a page of
    finished jobs, most of any history, is then one indexed query and a byte join).

    The page's ids are kept too, until anything changes (`ViewCache.page`): a page listed
    again while nothing changed costs no thread-pool hop and no query. The page is the same
    bytes `JobList.model_dump_json()` would give for these views."""
    token_hash = hash_token(presented_token(creds))
    cache.refresh()
    generation = cache.generation
    caller = cache.caller(token_hash)
    page = cache.page(page_key(caller, query)) if caller is not None else None
    views: dict[int, CachedView] = {}
    if caller is not None and page is not None:  # nothing changed since it was read: no hop
        (ids, next_cursor), read_caller = page, caller
    else:
        read = await run_in_threadpool(_page_ids, db, cache, creds, caller, query)
        ids, next_cursor, views, read_caller = read
        if caller is None:
            cache.store_caller(token_hash, read_caller, generation)
        cache.store_page(page_key(read_caller, query), (ids, next_cursor), generation)
    # (again: another page's render may have stored some while this one read its ids)
    views |= {job_id: view for job_id in ids if job_id not in views and (view := cache.view(job_id))}
    missing = tuple(job_id for job_id in ids if job_id not in views)
    if missing:
        views = {**views, **await asyncio.shield(_shared_render(db, cache, missing, read_caller))}
    bodies = [views[job_id].body for job_id in ids if job_id in views]
    return b'{"items":[' + b",".join(bodies) + b'],"next_cursor":' + json.dumps(next_cursor).encode() + b"}"


def page_key(caller: CachedCaller, query: ListQuery) -> PageKey:
    """Pages are the same for every admin, and for each other owner their own."""
    return (None if caller.is_admin else caller.user_id, query)


def _page_ids(
    db: Database,
    cache: ViewCache,
    creds: HTTPAuthorizationCredentials | None,
    caller: CachedCaller | None,
    query: ListQuery,
) -> tuple[list[int], str | None, dict[int, CachedView], CachedCaller]:
    """The page's ids and the views the cache holds of them (and the caller, the first time)."""
    if caller is None:  # the first page of a token (per TTL): its owner from the database
        with db.read() as session:
            user = current_user(session, creds)
        caller = CachedCaller(user_id=user.id, is_admin=user.is_admin, name=user.name)
    with db.read_connection() as conn:
        ids, next_cursor = service.list_job_ids(conn, None if caller.is_admin else caller.user_id, query)
    views = {job_id: view for job_id in ids if (view := cache.view(job_id)) is not None}
    return ids, next_cursor, views, caller


def _shared_render(
    db: Database, cache: ViewCache, job_ids: tuple[int, ...], viewer: CachedCaller
) -> asyncio.Future[dict[int, CachedView]]:
    """One read and render of the same missing jobs for every page that lacks them while
    nothing changed, as `_shared_read` does for one job: a running job on the newest page is
    invalidated at each progress report, and every client listing at that moment missed it at
    once. A view carries no trace of who asked (the ids were filtered by owner already)."""
    return shared_flight(
        cache,
        cache.renders_in_flight,
        job_ids,
        lambda generation: run_in_threadpool(_render, db, cache, job_ids, viewer, generation),
    )[1]


def _render(
    db: Database, cache: ViewCache, job_ids: tuple[int, ...], viewer: CachedCaller, generation: int
) -> dict[int, CachedView]:
    views = {}
    with db.read() as session:
        jobs = repo.jobs_by_ids(session, job_ids)
        for job, out in zip(jobs, service.job_views(session, jobs, viewer=viewer), strict=True):
            views[job.id] = view = CachedView(
                owner_id=job.owner_id, body=out.model_dump_json().encode(), storable=job.state != QUEUED
            )
            cache.store_view(job.id, view, generation)
    return views
