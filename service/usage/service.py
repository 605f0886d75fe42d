"""`GET /v1/usage` (contract §9): GPU-seconds per user over a time range."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from service.errors import Forbidden, InvalidQuery, NotFound
from service.models import User
from service.usage import repository
from service.usage.accounting import gpu_seconds, holds
from service.usage.schemas import UsageList, UsageOut
from service.users import repository as users_repo


def usage(
    session: Session, caller: User, user: str | None, since: datetime | None, until: datetime | None
) -> UsageList:
    """A user sees their own figure; the admin everyone's, or one user's. Each attempt counts
    the part of it inside [since, until] (aware UTC times: the router makes them so)."""
    if since is not None and until is not None and until <= since:
        raise InvalidQuery("until", "until must be after since")
    users = _subjects(session, caller, user)
    totals = {u.id: UsageOut(user=u.name, gpu_seconds=0.0, jobs=0, attempts=0) for u in users}
    jobs: dict[int, set[int]] = {u.id: set() for u in users}
    for held in holds(session, list(totals), since=since, until=until):
        seconds = gpu_seconds(held, since, until)
        row = totals[held.owner_id]
        row.gpu_seconds += seconds
        row.attempts += 1
        jobs[held.owner_id].add(held.job_id)
    stored = repository.checkpoint_bytes_by_owner(session, list(totals))
    for owner_id, row in totals.items():
        row.jobs, row.gpu_seconds = len(jobs[owner_id]), round(row.gpu_seconds, 3)
        row.checkpoint_bytes = stored.get(owner_id, 0)
    items = sorted(totals.values(), key=lambda r: (-r.gpu_seconds, r.user))
    return UsageList(items=items, since=since, until=until)


def _subjects(session: Session, caller: User, name: str | None) -> list[User]:
    if not caller.is_admin:
        if name is not None and name != caller.name:
            raise Forbidden("a user sees their own usage only")
        return [caller]
    found = list(users_repo.all_users(session, name))
    if name is not None and not found:
        raise NotFound(f"user {name!r}")
    return found
