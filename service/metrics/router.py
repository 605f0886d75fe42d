"""`GET /metrics`: Prometheus exposition of this app's registry.

Scraping needs a bearer token (any user's) unless ``TORCHJOBS_METRICS_PUBLIC`` is true, for a
Prometheus that scrapes from inside a private network without a token. Per-user series (a label
naming a user, such as ``torchjobs_user_gpu_seconds_total{user}``) are the admin's only
(contract §7): any other caller, and a scrape without a token, gets every other series.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from prometheus_client.exposition import choose_encoder

from service.api.deps import BearerCreds, DbDep, SettingsDep, current_user
from service.auth.tokens import presented_token, user_for_token
from service.errors import Unauthorized
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


def scraper_is_admin(settings: SettingsDep, db: DbDep, creds: BearerCreds) -> bool:
    """Whether the caller is the admin: a 401 without a valid token unless the metrics are public
    (then a missing or unknown token scrapes as nobody in particular: no per-user series). Checks the
    token in a short read of its own, not a request-long session (which would hold SQLite's
    write lock for the whole scrape)."""
    if settings.metrics_public and creds is None:
        return False
    with db.read() as session:
        if not settings.metrics_public:
            return current_user(session, creds).is_admin
        try:
            user = user_for_token(session, presented_token(creds))
        except Unauthorized:
            return False
        return user is not None and user.is_admin


@router.get("/metrics", response_class=Response)
def metrics(request: Request, admin: Annotated[bool, Depends(scraper_is_admin)]) -> Response:
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    registry = request.app.state.metrics.registry_for(admin=admin)
    return Response(content=encoder(registry), media_type=content_type)
