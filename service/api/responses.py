"""The error answers every API route may give, declared once so the OpenAPI schema shows them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorOut(BaseModel):
    detail: Any


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorOut, "description": description}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _err("missing, invalid or revoked bearer token"),
    403: _err("admin only"),
    404: _err("unknown, or not the caller's"),
    409: _err("impossible state transition or duplicate"),
    413: _err("request body too large"),
    416: _err("range not satisfiable"),
    422: _err("invalid request, with the field and why"),
}
