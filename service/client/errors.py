"""An API error and the reading of an answer, shared by the calls (`api`) and the downloads
(`download`), so that neither imports the other's module."""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(Exception):
    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code, self.detail = status_code, detail


def read_json(resp: httpx.Response) -> Any:
    """The answer's JSON (None for 204); an error status raises ApiError with the server's reason."""
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail")
        except (ValueError, AttributeError):
            detail = resp.text
        raise ApiError(resp.status_code, detail)
    return resp.json() if resp.status_code != 204 else None
