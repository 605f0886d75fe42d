"""Webhooks behind the API: register (target checked), list, delete, delivery history.

A user's webhook sees their own jobs' events; the admin's may ask for every user's (`all`).
Each registration's URL is checked when it is made (`check_url`, called by the router before
the request's transaction begins: resolving a name may take seconds, and on SQLite that
transaction holds the write lock) and again before every delivery.
"""

from __future__ import annotations

import re
import secrets

from sqlalchemy.orm import Session

from service.config import Settings
from service.errors import Conflict, InvalidQuery, InvalidSpec, NotFound
from service.models import User, Webhook, WebhookAttempt, WebhookDelivery
from service.schemas import MAX_ID
from service.webhooks import repository as repo
from service.webhooks.outbox import events_column, types_of
from service.webhooks.schemas import (
    AttemptOut,
    DeliveryList,
    DeliveryOut,
    WebhookCreated,
    WebhookIn,
    WebhookList,
    WebhookOut,
)
from service.webhooks.signing import event_id
from service.webhooks.targets import TargetRefused, Unresolved, check_target


def check_url(settings: Settings, url: str) -> None:
    """422 on `url` unless it is an http(s) URL whose host resolves to public addresses only
    (or to any, with TORCHJOBS_WEBHOOK_ALLOW_PRIVATE=true). A host that does not resolve yet
    is taken (contract §10 refuses what resolves to a private address, and DNS may come later):
    every delivery checks the target again, and a send to no address is a failed attempt,
    retried."""
    try:
        check_target(url, allow_private=settings.webhook_allow_private)
    except Unresolved:
        return
    except TargetRefused as exc:
        raise InvalidSpec(("url",), str(exc), "url_refused") from None


def create_webhook(session: Session, settings: Settings, user: User, body: WebhookIn) -> WebhookCreated:
    """The URL was checked already (`check_url`). The secret is generated when not given, and
    shown in this answer only."""
    if body.all and not user.is_admin:
        raise InvalidSpec(("all",), "only the admin may ask for every user's jobs")
    repo.lock_user(session, user.id)
    if repo.count_owned(session, user.id) >= settings.webhooks_per_user:
        raise Conflict(f"at most {settings.webhooks_per_user} webhooks per user; delete one first")
    secret = body.secret if body.secret is not None else secrets.token_hex(32)
    webhook = repo.add(
        session,
        Webhook(
            owner_id=user.id,
            url=body.url,
            events=events_column(body.events),
            secret=secret,
            all_jobs=body.all,
        ),
    )
    return WebhookCreated(**webhook_out(webhook, user.name).model_dump(), secret=secret)


def list_webhooks(session: Session, user: User) -> WebhookList:
    """The caller's own; the admin's list has everyone's."""
    rows = repo.visible(session, None if user.is_admin else user.id)
    return WebhookList(items=[webhook_out(webhook, owner) for webhook, owner in rows])


def get_webhook(session: Session, user: User, webhook_id: int) -> Webhook:
    """The caller's own webhook (the admin: anyone's); anyone else's is a 404, as unknown."""
    webhook = repo.get(session, webhook_id)
    if webhook is None or (webhook.owner_id != user.id and not user.is_admin):
        raise NotFound("webhook")
    return webhook


def delete_webhook(session: Session, webhook: Webhook) -> None:
    repo.remove(session, webhook.id)


def list_deliveries(session: Session, webhook: Webhook, limit: int, cursor: str | None) -> DeliveryList:
    """Newest first, each with its latest attempts; `next_cursor` pages on."""
    rows = repo.deliveries_page(session, webhook.id, _parse_cursor(cursor), limit + 1)
    page = rows[:limit]
    attempts = repo.attempts_of(session, [d.id for d in page])
    items = [delivery_out(d, attempts.get(d.id, [])) for d in page]
    return DeliveryList(items=items, next_cursor=str(page[-1].id) if len(rows) > limit and page else None)


def webhook_out(webhook: Webhook, owner: str) -> WebhookOut:
    return WebhookOut(
        id=webhook.id,
        url=webhook.url,
        events=types_of(webhook.events),
        all=webhook.all_jobs,
        owner=owner,
        created_at=webhook.created_at,
    )


def delivery_out(row: WebhookDelivery, attempts: list[WebhookAttempt]) -> DeliveryOut:
    return DeliveryOut(
        id=row.id,
        job_id=row.job_id,
        seq=row.seq,
        event_id=event_id(row.job_id, row.seq),
        status=row.status,  # "pending" | "delivered" | "failed"
        attempt_count=row.attempts,
        created_at=row.created_at,
        next_attempt_at=row.next_attempt_at if row.status == "pending" else None,
        delivered_at=row.delivered_at,
        last_status_code=row.last_status_code,
        last_error=row.last_error,
        attempts=[
            AttemptOut(at=a.at, status_code=a.status_code, error=a.error, duration_ms=a.duration_ms)
            for a in attempts
        ],
    )


def _parse_cursor(cursor: str | None) -> int | None:
    if cursor is None or cursor == "":
        return None
    if not re.fullmatch(r"[0-9]{1,10}", cursor) or int(cursor) > MAX_ID + 1:
        raise InvalidQuery("cursor", "invalid cursor")
    return int(cursor)
