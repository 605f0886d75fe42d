"""The error answers every API route may give, declared once so the OpenAPI schema shows them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorOut(BaseModel):
    detail: Any


ERROR_SCHEMA = ErrorOut.model_json_schema()


def _err(description: str) -> dict[str, Any]:
    # The schema inline under application/json: routes that answer text/plain or SSE still
    # answer their errors in JSON, and `model=` would file it under the route's media type.
    return {"description": description, "content": {"application/json": {"schema": ERROR_SCHEMA}}}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _err("a body that is not even JSON"),
    401: _err("missing, invalid or revoked bearer token"),
    403: _err("admin only"),
    404: _err("unknown, or not the caller's"),
    409: _err("impossible state transition or duplicate"),
    413: _err("request body too large"),
    416: _err("range not satisfiable"),
    405: _err("method not allowed; the Allow header lists those that are"),
    422: _err("invalid request, with the field and why"),
}
