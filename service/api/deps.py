"""Request-scoped dependencies: the session (one transaction per request), the caller, and
the "get it, or 404 if it is not yours" lookup that every job route shares.

FastAPI runs every plain `def` dependency in the thread pool, one hop each. Those that do no
I/O are `async def` here, and the session opens on the event loop (it connects lazily, at the
first query) and ends in one hop: a GET pays for its queries, not for thread handoffs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated, cast

import anyio
from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator, BeforeValidator, WithJsonSchema
from pydantic_core import PydanticUseDefault
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.auth.tokens import hash_token, presented_token, user_for_token, user_for_token_hash
from service.config import Settings
from service.db import Database
from service.errors import Forbidden, NotFound, Unauthorized
from service.jobs import service as jobs_service
from service.jobs.submit_cache import Caller, SubmitCache, Submitter
from service.models import Job, User, Webhook
from service.schemas import MAX_ID
from service.storage import Storage
from service.webhooks import service as webhooks_service

bearer = HTTPBearer(auto_error=False, description="torchjobs bearer token")
BearerCreds = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
# HTTP's safe methods: their routes only read, so their session is a read-only one
# (`Database.read_sessionmaker`: no write lock on SQLite, no BEGIN/COMMIT on PostgreSQL).
READ_METHODS = frozenset({"GET", "HEAD"})


def known_id(what: str) -> Callable[[int], int]:
    """An integer id that no row can have (0, negative, past MAX_ID) names nothing: a 404, as
    an unknown id in range is (contract §2), found without a query. A non-integer stays a 422.
    The NotFound raised here is not a ValueError, so it passes through validation untouched."""

    def check(value: int) -> int:
        if not 1 <= value <= MAX_ID:
            raise NotFound(what)
        return value

    return check


def _blank_is_absent(value: object) -> object:
    if value == "":
        raise PydanticUseDefault()
    return value


# `?state=&limit=` (the contract writes its routes so): an empty query value is the parameter
# left out, its default, rather than a 422 for "" not being a state or a number.
BlankIsAbsent = BeforeValidator(_blank_is_absent)


def int_or_blank(minimum: int, maximum: int) -> WithJsonSchema:
    """The OpenAPI schema of an integer query parameter with `BlankIsAbsent`: the integer, or
    the empty string that stands for leaving it out (so a client built from the schema knows)."""
    whole = {"type": "integer", "minimum": minimum, "maximum": maximum}
    return WithJsonSchema({"anyOf": [whole, {"type": "string", "maxLength": 0}]})


JobIdPath = Annotated[int, Path(), AfterValidator(known_id("job"))]
WebhookIdPath = Annotated[int, Path(), AfterValidator(known_id("webhook"))]
CheckpointIdPath = Annotated[int, Path(), AfterValidator(known_id("checkpoint"))]
UserIdPath = Annotated[int, Path(), AfterValidator(known_id("user"))]


async def presented_creds(creds: BearerCreds) -> HTTPAuthorizationCredentials:
    """A bearer token is there (not yet checked). FastAPI solves dependencies before it
    validates the route's own path: with this, a request without a token is a 401 before a
    malformed id is a 422, as on the routes whose dependencies look the user up."""
    presented_token(creds)
    return cast(HTTPAuthorizationCredentials, creds)  # presented_token raised if it is None


PresentedCreds = Annotated[HTTPAuthorizationCredentials, Depends(presented_creds)]


async def get_db(request: Request) -> Database:
    return request.app.state.db


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_storage(request: Request) -> Storage:
    """One Storage per app, built by the app's lifespan (no I/O: no thread-pool hop)."""
    storage: Storage = request.app.state.storage
    return storage


async def get_session(request: Request, db: Annotated[Database, Depends(get_db)]) -> AsyncIterator[Session]:
    """Commits when the handler returns, rolls back when it raises; nothing else commits.

    A request holds its session (and, from its first query, a pooled connection) across
    thread-pool hops: its dependencies, its handler, its commit. Unbounded, that deadlocked
    under load: with more requests in flight than threads plus connections, every thread
    waited for a connection held by a request that was waiting for a thread (measured: 100
    clients on GET /v1/jobs/{id}, 80 answers, then none until the pool's timeout). So a
    request first takes one of `request_sessions_max` slots, on the event loop, holding
    nothing; with a slot, a connection is always free."""
    slots: anyio.CapacityLimiter = request.app.state.session_slots  # made by the app's lifespan
    borrower = object()
    await slots.acquire_on_behalf_of(borrower)
    try:
        factory = db.read_sessionmaker if request.method in READ_METHODS else db.sessionmaker
        session = factory()
        committed = False
        try:
            yield session
            committed = True
        finally:
            # Shielded: a client that goes away mid-request must not leave the connection checked out.
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(_end_session, session, committed)
    finally:
        slots.release_on_behalf_of(borrower)


def _end_session(session: Session, commit: bool) -> None:
    try:
        if commit:
            session.commit()
        else:
            session.rollback()
    finally:
        session.close()


def current_user(
    session: Annotated[Session, Depends(get_session, scope="function")],
    creds: BearerCreds,
) -> User:
    user = user_for_token(session, presented_token(creds))
    if user is None:
        raise Unauthorized()
    return user


UNVERIFIED_CALLER = "unverified_caller"  # request.state: a token hash taken from the submit cache


async def submitter(
    request: Request,
    session: Annotated[Session, Depends(get_session, scope="function")],
    creds: BearerCreds,
) -> Submitter:
    """The caller of `POST /v1/jobs`: from the process's copy when it holds the token (no
    query, no thread-pool hop; the job's INSERT checks the copy, service.jobs.submit_cache),
    else as `current_user` finds it, and copied. A copy is marked on the request: should the
    request fail FastAPI's own validation (a 422 decided before the handler runs, where the
    INSERT never comes), `unverified_caller_revoked` asks the table first, so that a revoked
    token is a 401 there too, as `current_user` made it."""
    token_hash = hash_token(presented_token(creds))
    cache: SubmitCache = request.app.state.submit_cache
    known = cache.caller(token_hash)
    if known is not None:
        setattr(request.state, UNVERIFIED_CALLER, token_hash)
        return Submitter(known)
    user = await run_in_threadpool(current_user, session, creds)
    caller = Caller.of(user, token_hash)
    cache.store_caller(caller)
    return Submitter(caller, user)


async def unverified_caller_revoked(request: Request) -> bool:
    """Whether the request's caller came from the submit cache and its token holds no user now."""
    token_hash = getattr(request.state, UNVERIFIED_CALLER, None)
    if token_hash is None:
        return False
    return not await run_in_threadpool(_token_holder_exists, request.app.state.db, token_hash)


def _token_holder_exists(db: Database, token_hash: str) -> bool:
    with db.read() as session:
        return user_for_token_hash(session, token_hash) is not None


async def admin_user(user: Annotated[User, Depends(current_user)]) -> User:
    if not user.is_admin:
        raise Forbidden("admin only")
    return user


def caller_job(
    session: Annotated[Session, Depends(get_session, scope="function")],
    user: Annotated[User, Depends(current_user)],
    job_id: JobIdPath,
) -> Job:
    return jobs_service.get_job(session, user, job_id)


def caller_webhook(
    session: Annotated[Session, Depends(get_session, scope="function")],
    user: Annotated[User, Depends(current_user)],
    webhook_id: WebhookIdPath,
) -> Webhook:
    return webhooks_service.get_webhook(session, user, webhook_id)


# scope="function": the transaction commits when the handler returns, BEFORE the response is
# sent (FastAPI's default runs yield-dependency exits after it). A client that got its 201
# can read the job at once, and a commit that fails is a 5xx, never a 201 for nothing.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
UserDep = Annotated[User, Depends(current_user)]
AdminDep = Annotated[User, Depends(admin_user)]
JobDep = Annotated[Job, Depends(caller_job)]
WebhookDep = Annotated[Webhook, Depends(caller_webhook)]
SubmitterDep = Annotated[Submitter, Depends(submitter)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DbDep = Annotated[Database, Depends(get_db)]
StorageDep = Annotated[Storage, Depends(get_storage)]


def brief_user(db: DbDep, creds: PresentedCreds) -> User:
    """The caller, looked up in a short read of its own that ends before the handler runs: for
    routes that stream a body, which must not hold a session (or SQLite's lock) meanwhile."""
    with db.read() as session:
        return current_user(session, creds)


BriefUserDep = Annotated[User, Depends(brief_user)]
