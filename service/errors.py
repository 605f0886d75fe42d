"""Domain errors, each carrying its HTTP status; one handler in `service.app` renders them.

TorchJobsError (500, never raised on purpose)
├── Unauthorized          401  no, bad or revoked token
├── Forbidden             403  admin-only action by a user
├── NotFound              404  unknown, or not the caller's (the two are indistinguishable)
├── Conflict              409  an impossible state transition
├── TooLarge              413  a body past its limit
├── RangeNotSatisfiable   416  a download range outside the file
└── InvalidSpec           422  a request that parses but cannot be honoured, with its field
"""

from __future__ import annotations

from typing import Any


class TorchJobsError(Exception):
    status_code = 500

    def __init__(self, detail: Any = "internal error") -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthorized(TorchJobsError):
    status_code = 401

    def __init__(self, detail: Any = "missing or invalid bearer token") -> None:
        super().__init__(detail)


class Forbidden(TorchJobsError):
    status_code = 403


class NotFound(TorchJobsError):
    status_code = 404

    def __init__(self, what: str = "resource") -> None:
        super().__init__(f"{what} not found")


class Conflict(TorchJobsError):
    status_code = 409


class TooLarge(TorchJobsError):
    status_code = 413


class RangeNotSatisfiable(TorchJobsError):
    status_code = 416


class InvalidSpec(TorchJobsError):
    """Rendered like FastAPI's own 422s: a list of {loc, msg, type}, so clients parse one shape."""

    status_code = 422

    def __init__(self, loc: tuple[str | int, ...], msg: str, type_: str = "value_error") -> None:
        super().__init__([{"loc": ["body", *loc], "msg": msg, "type": type_}])


class InvalidQuery(InvalidSpec):
    """A 422 for a query parameter, in the same shape."""

    def __init__(self, name: str, msg: str) -> None:
        TorchJobsError.__init__(self, [{"loc": ["query", name], "msg": msg, "type": "value_error"}])
