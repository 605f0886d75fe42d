"""All SQL about webhooks and their deliveries, but the enqueue (`outbox.py`, which the event
writers call in their own transaction)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Row, Select, delete, exists, func, insert, or_, select, update
from sqlalchemy.orm import Session, aliased

from service.models import JobEvent, User, Webhook, WebhookAttempt, WebhookDelivery
from service.webhooks.outbox import PENDING

ATTEMPTS_SHOWN = 50  # per delivery, newest first


# -- registrations ---------------------------------------------------------------------------


def lock_user(session: Session, user_id: int) -> None:
    """Serialise one user's registrations (their count is checked, then a row added). SQLite:
    the request's BEGIN IMMEDIATE already does."""
    session.execute(select(User.id).where(User.id == user_id).with_for_update())


def count_owned(session: Session, owner_id: int) -> int:
    return session.execute(
        select(func.count()).select_from(Webhook).where(Webhook.owner_id == owner_id)
    ).scalar_one()


def add(session: Session, webhook: Webhook) -> Webhook:
    session.add(webhook)
    session.flush()
    return webhook


def get(session: Session, webhook_id: int) -> Webhook | None:
    return session.get(Webhook, webhook_id)


def visible(session: Session, owner_id: int | None) -> list[tuple[Webhook, str]]:
    """(webhook, owner name), oldest first; `owner_id` None: everyone's."""
    query = select(Webhook, User.name).join(User, User.id == Webhook.owner_id).order_by(Webhook.id)
    if owner_id is not None:
        query = query.where(Webhook.owner_id == owner_id)
    return [(row[0], row[1]) for row in session.execute(query)]


def owner_name(session: Session, owner_id: int) -> str:
    return session.execute(select(User.name).where(User.id == owner_id)).scalar_one()


def remove(session: Session, webhook_id: int) -> None:
    """Its deliveries and their attempts go with it (ON DELETE CASCADE); deleted explicitly
    too, for a SQLite connection without foreign keys on."""
    deliveries = select(WebhookDelivery.id).where(WebhookDelivery.webhook_id == webhook_id)
    session.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(deliveries)))
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id))
    session.execute(delete(Webhook).where(Webhook.id == webhook_id))


# -- delivery history ------------------------------------------------------------------------


def deliveries_page(
    session: Session, webhook_id: int, before_id: int | None, limit: int
) -> Sequence[WebhookDelivery]:
    query = select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
    if before_id is not None:
        query = query.where(WebhookDelivery.id < before_id)
    return session.execute(query.order_by(WebhookDelivery.id.desc()).limit(limit)).scalars().all()


def attempts_of(session: Session, delivery_ids: Sequence[int]) -> dict[int, list[WebhookAttempt]]:
    """The latest `ATTEMPTS_SHOWN` attempts of each delivery, newest first."""
    if not delivery_ids:
        return {}
    ranked = (
        select(
            WebhookAttempt.id,
            func.row_number()
            .over(partition_by=WebhookAttempt.delivery_id, order_by=WebhookAttempt.id.desc())
            .label("n"),
        )
        .where(WebhookAttempt.delivery_id.in_(delivery_ids))
        .subquery()
    )
    rows = (
        session.execute(
            select(WebhookAttempt)
            .join(ranked, ranked.c.id == WebhookAttempt.id)
            .where(ranked.c.n <= ATTEMPTS_SHOWN)
            .order_by(WebhookAttempt.delivery_id, WebhookAttempt.id.desc())
        )
        .scalars()
        .all()
    )
    found: dict[int, list[WebhookAttempt]] = {}
    for row in rows:
        found.setdefault(row.delivery_id, []).append(row)
    return found


# -- the dispatcher --------------------------------------------------------------------------


def _due_heads(now: datetime) -> Select[Any]:
    """Pending deliveries, due, not leased, with no earlier pending delivery of the same
    (webhook, job): one job's events go out one at a time, in `seq` order."""
    earlier = aliased(WebhookDelivery)
    return (
        select(WebhookDelivery.id)
        .where(
            WebhookDelivery.status == PENDING,
            WebhookDelivery.next_attempt_at <= now,
            _lease_free(now),
            ~exists().where(
                earlier.webhook_id == WebhookDelivery.webhook_id,
                earlier.job_id == WebhookDelivery.job_id,
                earlier.status == PENDING,
                earlier.seq < WebhookDelivery.seq,
            ),
        )
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
    )


def _lease_free(now: datetime) -> ColumnElement[bool]:
    return or_(WebhookDelivery.lease_until.is_(None), WebhookDelivery.lease_until < now)


def any_due(session: Session, now: datetime) -> bool:
    """Whether a head is due: the look before a claim's write transaction (on SQLite, that
    takes the database's write lock)."""
    return session.execute(_due_heads(now).limit(1)).first() is not None


def claim_due(session: Session, now: datetime, limit: int, lease_until: datetime) -> list[int]:
    """Lease up to `limit` due heads (`_due_heads`). The lease is a compare-and-set
    (`lease_until` still free), so two processes never both take one; on PostgreSQL the rows
    another claimer holds are skipped, not waited for."""
    heads = _due_heads(now).limit(limit).with_for_update(skip_locked=True)
    ids: Sequence[int] = session.execute(heads).scalars().all()
    if not ids:
        return []
    claimed = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id.in_(ids), WebhookDelivery.status == PENDING, _lease_free(now))
        .values(lease_until=lease_until)
        .returning(WebhookDelivery.id)
        .execution_options(synchronize_session=False)
    )
    return sorted(claimed.scalars().all())


def for_sending(session: Session, delivery_id: int) -> Row[Any] | None:
    """What one send needs: the delivery, its webhook's URL and secret, and the event."""
    return session.execute(
        select(
            WebhookDelivery.id,
            WebhookDelivery.job_id,
            WebhookDelivery.seq,
            WebhookDelivery.attempts,
            WebhookDelivery.created_at,
            Webhook.url,
            Webhook.secret,
            JobEvent.ts,
            JobEvent.type,
            JobEvent.data,
        )
        .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
        .outerjoin(
            JobEvent, (JobEvent.job_id == WebhookDelivery.job_id) & (JobEvent.seq == WebhookDelivery.seq)
        )
        .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == PENDING)
    ).one_or_none()


def record(
    session: Session,
    delivery_id: int,
    *,
    at: datetime,
    status_code: int | None,
    error: str | None,
    duration_ms: int,
    status: str,
    next_attempt_at: datetime,
    delivered_at: datetime | None,
) -> bool:
    """One attempt and the delivery's new status, lease released; False, recording nothing,
    when the delivery is gone (its webhook deleted meanwhile) or no longer pending."""
    updated = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == PENDING)
        .values(
            status=status,
            attempts=WebhookDelivery.attempts + 1,
            next_attempt_at=next_attempt_at,
            lease_until=None,
            delivered_at=delivered_at,
            last_status_code=status_code,
            last_error=error,
        )
        .returning(WebhookDelivery.id)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if updated is None:
        return False
    session.execute(
        insert(WebhookAttempt).values(
            delivery_id=delivery_id, at=at, status_code=status_code, error=error, duration_ms=duration_ms
        )
    )
    return True
