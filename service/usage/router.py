from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import BlankIsAbsent, SessionDep, UserDep
from service.errors import InvalidQuery
from service.usage import service
from service.usage.schemas import UsageList

router = APIRouter(prefix="/v1", tags=["usage"])
ISO_TIME = r"^(\d{4}-\d{2}-\d{2}([T ][0-9:.]+(Z|[+-]\d{2}:?\d{2})?)?)?$"  # or empty: left out
Moment = Annotated[
    str | None,
    Query(max_length=40, pattern=ISO_TIME, description="ISO 8601, e.g. 2026-12-01T00:00:00Z; no zone: UTC"),
    BlankIsAbsent,
]


@router.get("/usage", response_model=UsageList)
def usage(
    session: SessionDep,
    caller: UserDep,
    user: Annotated[str | None, Query(max_length=128, pattern=r"^[^\x00-\x1f]*$"), BlankIsAbsent] = None,
    since: Moment = None,
    until: Moment = None,
) -> UsageList:
    """GPU-seconds per user in [since, until] (contract §9): yours, or everyone's for the admin."""
    return service.usage(session, caller, user, _moment("since", since), _moment("until", until))


def _moment(name: str, text: str | None) -> datetime | None:
    """An ISO 8601 time, never a bare number (which the lax parser would read as epoch seconds)."""
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
        return moment.astimezone(UTC) if moment.tzinfo else moment.replace(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise InvalidQuery(name, f"{text!r} is not an ISO 8601 time (or is out of range in UTC)") from None
