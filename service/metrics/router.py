"""`GET /metrics`: Prometheus exposition of this app's registry.

Scraping needs a bearer token (any user's) unless ``TORCHJOBS_METRICS_PUBLIC`` is true, for a
Prometheus that scrapes from inside a private network without a token.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from prometheus_client.exposition import choose_encoder

from service.api.deps import BearerCreds, DbDep, SettingsDep, current_user
from service.metrics.collector import AppMetrics
from service.metrics.middleware import RequestLatencyMiddleware

router = APIRouter(tags=["metrics"])


def install(app: FastAPI) -> AppMetrics:
    """The app's own registry, timing every request; call once, in `create_app`, which keeps it
    on `app.state` (service/app.py owns app.state)."""
    metrics = AppMetrics(
        database=lambda: app.state.db, view_cache=lambda: getattr(app.state, "view_cache", None)
    )
    app.add_middleware(RequestLatencyMiddleware, histogram=metrics.http_latency)
    return metrics


def scrape_allowed(
    settings: SettingsDep,
    db: DbDep,
    creds: BearerCreds,
) -> None:
    """Checks the token in a short read of its own, not a request-long session (which would hold
    SQLite's write lock for the whole scrape)."""
    if not settings.metrics_public:
        with db.read() as session:
            current_user(session, creds)


@router.get("/metrics", dependencies=[Depends(scrape_allowed)], response_class=Response)
def metrics(request: Request) -> Response:
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(content=encoder(request.app.state.metrics.registry), media_type=content_type)
