"""`GET /` (the page) and `GET /dashboard/{path}` (its script, styles and vendored chart library)."""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from service import __version__
from service.errors import NotFound

STATIC_DIR = Path(__file__).resolve().parent / "static"

# Everything the page loads comes from this origin; the only scripts are our files.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(tags=["dashboard"], include_in_schema=False)
# A route rather than a mount: it is matched like every other route, so request metrics label
# it by its template. StaticFiles still does the serving (ETag, 304s, no path escapes the folder).
_assets = StaticFiles(directory=STATIC_DIR)


@router.get("/", response_class=HTMLResponse)
def dashboard() -> HTMLResponse:
    # The version in the asset URLs makes a browser fetch new assets after an upgrade.
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8").replace("__VERSION__", __version__)
    return HTMLResponse(page, headers=SECURITY_HEADERS)


@router.get("/dashboard/{path:path}")
async def dashboard_asset(path: str, request: Request) -> Response:
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise NotFound("file")
    response = await _assets.get_response(os.path.normpath(os.path.join(*parts)), request.scope)
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response
