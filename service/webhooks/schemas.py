"""Request and response bodies of the webhook routes."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from service.jobs.spec import Input

# Every event type the service writes (grep `append_event(` and `append_attempt_events(`):
# a webhook may ask for any of them, and for nothing else.
EventType = Literal["state", "progress", "checkpoint", "stall", "quarantine", "environment"]
MAX_URL = 2048
# Any key a user picks (the contract sets no rule), but no control characters: it travels in
# JSON and is used as its UTF-8 bytes.
SECRET = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]


def default_events() -> list[EventType]:
    return ["state"]


class WebhookIn(Input):
    url: str = Field(min_length=1, max_length=MAX_URL, description="http(s) URL the events are POSTed to")
    events: list[EventType] = Field(default_factory=default_events, min_length=1, max_length=16)
    secret: SECRET | None = Field(
        None, description="HMAC-SHA256 key (1-256 characters, no control characters); generated when absent"
    )
    all: bool = Field(False, description="the admin only: every user's jobs, not only their own")


class WebhookOut(BaseModel):
    id: int
    url: str
    events: list[str]
    all: bool
    owner: str
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str  # shown in this answer only


class WebhookList(BaseModel):
    items: list[WebhookOut]


class AttemptOut(BaseModel):
    at: datetime
    status_code: int | None  # null: no answer (refused, timed out, the address not allowed)
    error: str | None
    duration_ms: int


class DeliveryOut(BaseModel):
    id: int
    job_id: int
    seq: int
    event_id: str  # "JOB:SEQ", as in the X-Torchjobs-Event-Id header
    status: Literal["pending", "delivered", "failed"]
    attempt_count: int
    created_at: datetime
    next_attempt_at: datetime | None  # while pending
    delivered_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    attempts: list[AttemptOut]  # newest first, at most the latest 50


class DeliveryList(BaseModel):
    items: list[DeliveryOut]
    next_cursor: str | None
