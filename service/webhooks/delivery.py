"""One delivery: read it, send it outside any transaction, record what came of it at once.

`Sender.deliver()` runs in the dispatcher's pool (`dispatcher.py`) for a delivery it leased:
a short read, then the POST with no transaction open, then one short transaction that
records the attempt and the delivery's new status (`judge()`, pure: delivered on a 2xx, else
tried again after a backoff, or given up once the retry window has passed).

The target is checked again before every send (`targets.check_target`), and the connection
goes to the very addresses that check passed: a name that moved to a private address since
registration is refused, whatever DNS answers next.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
from sqlalchemy.exc import OperationalError
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from service import __version__
from service.config import Settings
from service.db import Database
from service.jobs.schemas import EventOut
from service.models import utcnow
from service.webhooks import repository as repo
from service.webhooks.backoff import RetryPolicy
from service.webhooks.signing import headers as signed_headers
from service.webhooks.signing import render_body
from service.webhooks.targets import Resolver, Target, TargetRefused, check_target

log = logging.getLogger("torchjobs.webhooks")
Clock = Callable[[], datetime]
DELIVERED, FAILED, PENDING = "delivered", "failed", "pending"
MAX_ERROR = 500
# A database that is away when an answer is to be recorded: tried again for this long before
# the lease is left to run out (and the event, perhaps already accepted, is sent once more).
RECORD_RETRY_S = 5.0
LEASE_MARGIN_S = 5.0


def lease_s(settings: Settings) -> float:
    """How long a leased delivery is the sender's: longer than one send can take (the name's
    lookup; connect, write and read, each within the timeout; a connect to a second address
    of the host) and its recording. A process that dies mid-send holds its deliveries this
    long; then another process (or the same one, restarted) takes them again."""
    return 4 * settings.webhook_timeout_s + RECORD_RETRY_S + LEASE_MARGIN_S


@dataclass(frozen=True)
class Outcome:
    status_code: int | None  # None: no answer
    error: str | None
    duration_ms: int
    final: bool = False  # no later try can do better (the event is gone)

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


@dataclass(frozen=True)
class Verdict:
    status: str
    next_attempt_at: datetime
    delivered_at: datetime | None


def judge(
    outcome: Outcome, failures_before: int, created_at: datetime, now: datetime, policy: RetryPolicy
) -> Verdict:
    """Delivered on a 2xx; else failed once the retry window since the event has passed (or
    nothing could ever succeed); else pending, due again after the backoff."""
    if outcome.ok:
        return Verdict(DELIVERED, now, now)
    if outcome.final or policy.gives_up(created_at, now):
        return Verdict(FAILED, now, None)
    return Verdict(PENDING, policy.next_try(failures_before + 1, now), None)


def policy_of(settings: Settings) -> RetryPolicy:
    return RetryPolicy(
        initial_s=settings.webhook_backoff_initial_s,
        max_s=settings.webhook_backoff_max_s,
        retry_for_s=settings.webhook_retry_for_s,
    )


def make_http(settings: Settings, transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """No redirects, no proxies from the environment (they would connect elsewhere than the
    address checked), and no kept connections: a connection is made for the address and TLS
    name of one target, so it is never reused for another that shares its address."""
    return httpx.Client(
        timeout=settings.webhook_timeout_s,
        follow_redirects=False,
        trust_env=False,
        limits=httpx.Limits(max_keepalive_connections=0),
        headers={"User-Agent": f"torchjobs-webhooks/{__version__}"},
        transport=transport,
    )


def post(
    http: httpx.Client, target: Target, body: bytes, headers: dict[str, str], budget_s: float
) -> Outcome:
    """POST to the target's checked addresses in turn until one connects (within `budget_s`);
    only the status line is read."""
    started = time.monotonic()
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    error = "no address to connect to"
    for address in target.addresses:
        request = http.build_request(
            "POST",
            target.request_url(address),
            content=body,
            headers={**headers, "Host": target.host_header},
            extensions=extensions,
        )
        try:
            response = http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            error = _describe(exc, address)
            if time.monotonic() - started < budget_s:
                continue
            break
        except httpx.HTTPError as exc:
            return Outcome(None, _describe(exc, address), _ms_since(started))
        try:
            code = response.status_code
        finally:
            response.close()
        if 200 <= code < 300:
            return Outcome(code, None, _ms_since(started))
        why = f"HTTP {code}" + (": redirects are not followed" if 300 <= code < 400 else "")
        return Outcome(code, why, _ms_since(started))
    return Outcome(None, error, _ms_since(started))


def send(
    http: httpx.Client,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    allow_private: bool,
    timeout_s: float,
    resolver: Resolver = socket.getaddrinfo,
) -> Outcome:
    """Check the target now, then POST to the addresses checked."""
    started = time.monotonic()
    try:
        target = check_target(url, allow_private=allow_private, resolver=resolver)
    except TargetRefused as exc:
        return Outcome(None, f"not sent: {exc}"[:MAX_ERROR], _ms_since(started))
    return post(http, target, body, headers, timeout_s)


class Sender:
    """Sends leased deliveries; one per dispatcher, shared by its pool's threads."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        clock: Clock = utcnow,
        resolver: Resolver = socket.getaddrinfo,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.db, self.settings, self.clock, self.resolver = db, settings, clock, resolver
        self.policy = policy_of(settings)
        self.http = make_http(settings, transport)

    def close(self) -> None:
        self.http.close()

    def deliver(self, delivery_id: int) -> Outcome | None:
        """Send one leased delivery and record the attempt; None when it was no longer there."""
        with self.db.read() as session:
            row = repo.for_sending(session, delivery_id)
        if row is None:
            return None
        outcome = self._attempt(row)
        now = self.clock()
        verdict = judge(outcome, row.attempts, row.created_at, now, self.policy)
        for attempt in Retrying(
            retry=retry_if_exception_type(OperationalError),
            stop=stop_after_delay(RECORD_RETRY_S),
            wait=wait_exponential(multiplier=0.5, max=5),
            reraise=True,
        ):
            with attempt, self.db.transaction() as session:
                repo.record(
                    session,
                    delivery_id,
                    at=now,
                    status_code=outcome.status_code,
                    error=outcome.error,
                    duration_ms=outcome.duration_ms,
                    status=verdict.status,
                    next_attempt_at=verdict.next_attempt_at,
                    delivered_at=verdict.delivered_at,
                )
        if verdict.status == FAILED:
            log.warning(
                "webhook delivery %s (event %s:%s) given up: %s",
                delivery_id,
                row.job_id,
                row.seq,
                outcome.error,
            )
        return outcome

    def _attempt(self, row: Any) -> Outcome:
        if row.type is None:
            return Outcome(None, "the event no longer exists", 0, final=True)
        event = EventOut(seq=row.seq, ts=row.ts, type=row.type, data=row.data).model_dump(mode="json")
        body = render_body(row.job_id, event)
        return send(
            self.http,
            row.url,
            body,
            signed_headers(row.secret, body, row.job_id, row.seq, row.type),
            allow_private=self.settings.webhook_allow_private,
            timeout_s=self.settings.webhook_timeout_s,
            resolver=self.resolver,
        )


def _describe(exc: BaseException, address: str) -> str:
    text = str(exc) or exc.__class__.__name__
    return f"{exc.__class__.__name__} ({address}): {text}"[:MAX_ERROR]


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
