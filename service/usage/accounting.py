"""GPU-seconds (contract §9): every attempt from its start to its end, times its GPUs, failed
and cancelled ones too. An ended attempt has its figure stored (`JobAttempt.gpu_seconds`,
written as it closes); a running one counts up to the moment it is read."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from service.models import JobAttempt, utcnow
from service.usage import repository as repo


@dataclass(frozen=True, kw_only=True)
class Held:
    """One attempt's hold on GPUs: from `start` to `end` (None: still running)."""

    job_id: int
    owner_id: int
    gpus: int
    start: datetime
    end: datetime | None


def held_seconds(start: datetime, end: datetime, gpus: int) -> float:
    """The one formula: GPUs times the time between, never negative (clocks can disagree)."""
    return max(0.0, (end - start).total_seconds()) * gpus


def gpu_seconds(held: Held, since: datetime | None = None, until: datetime | None = None) -> float:
    """Its GPU-seconds inside [since, until] (either open), a running one up to now."""
    end = held.end or utcnow()
    lo = max(held.start, since) if since else held.start
    hi = min(end, until) if until else end
    return held_seconds(lo, hi, held.gpus)


def attempt_gpu_seconds(attempt: JobAttempt, now: datetime | None = None) -> float:
    """An attempt's figure: stored once it ended, counted up to `now` while it runs."""
    if attempt.started_at is None:
        return 0.0
    if attempt.finished_at is not None:
        return attempt.gpu_seconds
    return held_seconds(attempt.started_at, now or utcnow(), attempt.gpus)


def holds(
    session: Session,
    owner_ids: Iterable[int] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Sequence[Held]:
    """Every attempt that held GPUs at some moment of [since, until], of these owners (all: None)."""
    return [
        Held(job_id=r.job_id, owner_id=r.owner_id, gpus=r.gpus, start=r.started_at, end=r.finished_at)
        for r in repo.attempts_holding(session, owner_ids, since, until)
    ]


def totals_by_owner(session: Session, now: datetime | None = None) -> dict[int, float]:
    """Every owner's GPU-seconds of all time: ended attempts summed in the database, running
    ones counted up to `now` (a Prometheus counter: it only grows)."""
    ended = repo.ended_gpu_seconds_by_owner(session)
    totals = {owner: float(seconds or 0.0) for owner, seconds in ended}
    running = repo.running_attempts(session)
    at = now or utcnow()
    for owner, gpus, started in running:
        if started is not None:  # (the query asks for none)
            totals[owner] = totals.get(owner, 0.0) + held_seconds(started, at, gpus)
    return totals
