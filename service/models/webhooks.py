"""Webhooks (contract §10): who wants which events, and the outbox of their deliveries.

`webhook_deliveries` is a durable outbox: one row per (webhook, job, seq), written in the
transaction that wrote the event (`service.webhooks.outbox.enqueue`), sent later by the
dispatcher thread (`service.webhooks.dispatcher`) outside any transaction, and marked
`delivered` after the receiver's 2xx. Every try is kept in `webhook_attempts`.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Boolean, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, UTCDateTime, utcnow


class Webhook(Base):
    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    # The event types, as ",state,checkpoint,": one LIKE '%,' || type || ',%' matches a type
    # in plain SQL on SQLite and PostgreSQL alike (`service.webhooks.outbox`).
    events: Mapped[str] = mapped_column(String(256))
    secret: Mapped[str] = mapped_column(String(256))  # kept to sign with; never shown after creation
    all_jobs: Mapped[bool] = mapped_column(Boolean, default=False)  # the admin's: every user's jobs
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("webhook_id", "job_id", "seq"),
        # the dispatcher's look for due heads: pending rows by due time
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        # GET /v1/webhooks/{id}/deliveries, newest first
        Index("ix_webhook_deliveries_webhook_id_id", "webhook_id", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    webhook_id: Mapped[int] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    # "pending" until a 2xx ("delivered") or until it is given up ("failed"); only the
    # dispatcher's `service.webhooks.delivery.record` moves it. Named `status`, not `state`:
    # it is no job, node or worker state (tests/test_state_gates.py guards those).
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime)  # a sender holds it until then
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)


class WebhookAttempt(Base):
    __tablename__ = "webhook_attempts"
    __table_args__ = (Index("ix_webhook_attempts_delivery_id_id", "delivery_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    delivery_id: Mapped[int] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    status_code: Mapped[int | None] = mapped_column(Integer)  # None: no answer
    error: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[int] = mapped_column(Integer)
