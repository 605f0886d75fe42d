"""The FastAPI application: routers, error rendering, body limits, and the scheduler thread."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service import __version__
from service.api.deps import UserDep, unverified_caller_revoked
from service.api.limits import BodyLimitMiddleware
from service.api.responses import ERROR_RESPONSES
from service.auth.tokens import ensure_admin
from service.checkpoints.router import router as checkpoints_router
from service.code.router import router as code_router
from service.config import Settings
from service.dashboard.router import router as dashboard_router
from service.db import Database, unavailable_reason
from service.errors import TorchJobsError, Unauthorized
from service.exec.router import router as exec_router
from service.hosts.router import router as hosts_router
from service.jobs.router import router as jobs_router
from service.jobs.submit_cache import SubmitCache
from service.jobs.view_cache import ViewCache
from service.jobs.view_feed import ViewFeed
from service.metrics.router import install as install_metrics
from service.metrics.router import router as metrics_router
from service.scheduler.placement_pass import Dispatch
from service.scheduler.thread import SchedulerThread
from service.schemas import json_safe
from service.storage import Storage
from service.streams.router import router as streams_router
from service.streams.service import Streams
from service.uploads import sweep_partials
from service.usage.router import router as usage_router
from service.users.router import router as users_router
from service.wakeups.message import is_redis
from service.wakeups.publish import freed_signal_path
from service.wakeups.scheduler import FreedGpuFileWatcher, FreedGpuListener
from service.webhooks.dispatcher import WebhookDispatcher
from service.webhooks.router import router as webhooks_router

log = logging.getLogger("torchjobs.api")
DATABASE_RETRY_AFTER_S = 2


def create_app(settings: Settings | None = None, *, scheduler: bool = True) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = Database(settings)
        app.state.db, app.state.settings = db, settings
        app.state.session_slots = anyio.CapacityLimiter(db.request_sessions_max)
        app.state.storage = Storage.from_settings(settings)
        sweep_partials(settings.home / "tmp" / "code")
        with db.transaction() as session:
            ensure_admin(session, settings)
        log.info(
            "torchjobs %s API up on %s, scheduler %s",
            __version__,
            db.engine.dialect.name,
            "on" if scheduler else "off",
        )
        thread = listener = webhooks = None
        if scheduler:
            thread = SchedulerThread(db, settings, _celery_dispatcher(settings))
            thread.observe_pass = app.state.metrics.scheduler_pass.observe
            thread.start()
            listener = _freed_gpu_wakeups(settings, thread.wake)
            listener.start()
            webhooks = WebhookDispatcher(db, settings)  # contract §10: the outbox, sent
            webhooks.start()
        app.state.scheduler = thread
        app.state.view_cache = ViewCache(settings.job_view_cache_ttl_s)
        app.state.submit_cache = SubmitCache()
        view_feed = ViewFeed(db, app.state.view_cache)
        await view_feed.start()
        app.state.streams = Streams(db, settings)
        await app.state.streams.start()
        try:
            yield
        finally:
            await app.state.streams.stop()
            await view_feed.stop()
            if listener is not None:
                listener.stop()
            if webhooks is not None:
                webhooks.stop()
            if thread is not None:
                thread.stop()
                thread.join(timeout=5)
            if webhooks is not None:  # sends under way are finished and recorded
                webhooks.join(timeout=settings.webhook_timeout_s + 5)
            db.dispose()

    app = FastAPI(
        title="torchjobs",
        version=__version__,
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(
        BodyLimitMiddleware,
        default_limit=settings.max_request_bytes,
        upload_limits={"/v1/checkpoints": settings.max_upload_bytes, "/v1/code": settings.max_code_bytes},
    )
    app.state.metrics = install_metrics(app)
    _install_error_handlers(app)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(_user: UserDep) -> dict[str, Any]:
        """The schema too is for token holders only: strangers learn nothing."""
        return app.openapi()

    routers = (
        jobs_router,
        streams_router,
        checkpoints_router,
        code_router,
        users_router,
        hosts_router,
        usage_router,
        webhooks_router,
        metrics_router,
        dashboard_router,
        exec_router,
    )
    for router in routers:
        app.include_router(router, responses=ERROR_RESPONSES)
    _document_streams(app)
    return app


def _document_streams(app: FastAPI) -> None:
    """FastAPI documents a streaming response as one string; say what each SSE message is."""
    from service.streams.router import SSE_MESSAGE

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, item in schema["paths"].items():
                if path.endswith("/stream") and "get" in item:
                    ok = item["get"]["responses"]["200"]
                    ok["content"] = {"text/event-stream": {"schema": SSE_MESSAGE}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _freed_gpu_wakeups(
    settings: Settings, wake: Callable[[], None]
) -> FreedGpuListener | FreedGpuFileWatcher:
    """Redis pub/sub in production; the signal file under TORCHJOBS_HOME on the embedded setup."""
    url = settings.resolved_broker_url
    if is_redis(url):
        return FreedGpuListener(url, wake)
    return FreedGpuFileWatcher(freed_signal_path(settings), wake)


def _celery_dispatcher(settings: Settings) -> Callable[[list[Dispatch]], None]:
    from service.nodes.wire import send_node
    from workers.celery_app import make_celery

    celery = make_celery(settings)

    def dispatch(items: list[Dispatch]) -> None:
        for item in items:
            send_node(
                celery, job_id=item.job_id, attempt=item.attempt, node_rank=item.node_rank, worker=item.worker
            )

    return dispatch


def _allowed_methods(app: FastAPI, path: str) -> list[str]:
    if not hasattr(app.state, "path_methods"):
        table = []
        for template, item in app.openapi()["paths"].items():
            pattern = re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)) + "$")
            table.append((pattern, sorted(m.upper() for m in item)))
        app.state.path_methods = table
    return sorted({m for pattern, methods in app.state.path_methods if pattern.match(path) for m in methods})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TorchJobsError)
    async def _domain_error(_request: Request, exc: TorchJobsError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return JSONResponse({"detail": json_safe(exc.detail)}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Starlette's 405 names only the first route on the path; list every method it has."""
        if exc.status_code != 405:
            return await http_exception_handler(request, exc)
        methods = _allowed_methods(app, request.url.path)
        headers = {"Allow": ", ".join(methods)} if methods else dict(exc.headers or {})
        return JSONResponse({"detail": "Method Not Allowed"}, status_code=405, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422, with the quoted input made sendable: a lone surrogate in a body made
        its own encoder fail, a 500 for a bad request. A revoked token whose caller came from
        the submit cache is the 401 that looking it up would have raised first."""
        try:
            revoked = await unverified_caller_revoked(request)
        except OperationalError as away:  # as `current_user` failing there would have answered
            return await _database_away(request, away)
        if revoked:
            return await _domain_error(request, Unauthorized())
        return JSONResponse({"detail": json_safe(jsonable_encoder(exc.errors()))}, status_code=422)

    @app.exception_handler(OperationalError)
    async def _database_away(_request: Request, exc: OperationalError) -> JSONResponse:
        """The database refusing (a restart, a fail-over, SQLite's lock held too long): the
        request changed nothing, since its transaction did not commit, and may be sent again."""
        log.warning("database unavailable: %s", unavailable_reason(exc))
        return JSONResponse(
            {"detail": "the database is unavailable; try again"},
            status_code=503,
            headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse({"detail": "internal error"}, status_code=500)
