"""Webhook routes (contract §10): register, list, delete, and each one's delivery history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from service.api.deps import (
    BlankIsAbsent,
    BriefUserDep,
    SessionDep,
    SettingsDep,
    UserDep,
    WebhookDep,
    int_or_blank,
)
from service.webhooks import service
from service.webhooks.schemas import DeliveryList, WebhookCreated, WebhookIn, WebhookList

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


def checked_webhook(_user: BriefUserDep, body: WebhookIn, settings: SettingsDep) -> WebhookIn:
    """The body, its URL resolved and checked before the request's transaction begins (a
    name may take seconds to resolve; on SQLite that transaction holds the write lock)."""
    service.check_url(settings, body.url)
    return body


@router.post("", status_code=201, response_model=WebhookCreated)
def create_webhook(
    body: Annotated[WebhookIn, Depends(checked_webhook)],
    session: SessionDep,
    settings: SettingsDep,
    user: UserDep,
) -> WebhookCreated:
    """Events of the caller's jobs (the admin's, with `all`: everyone's) are POSTed to `url`,
    signed with `secret`; a secret generated here is shown in this answer only."""
    return service.create_webhook(session, settings, user, body)


@router.get("", response_model=WebhookList)
def list_webhooks(session: SessionDep, user: UserDep) -> WebhookList:
    return service.list_webhooks(session, user)


@router.delete("/{webhook_id}", status_code=204)
def delete_webhook(webhook: WebhookDep, session: SessionDep) -> Response:
    service.delete_webhook(session, webhook)
    return Response(status_code=204)


@router.get("/{webhook_id}/deliveries", response_model=DeliveryList)
def list_deliveries(
    webhook: WebhookDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100), BlankIsAbsent, int_or_blank(1, 100)] = 20,
    cursor: Annotated[str | None, Query(max_length=32), BlankIsAbsent] = None,
) -> DeliveryList:
    """Newest first, each with its latest attempts and their HTTP status."""
    return service.list_deliveries(session, webhook, limit, cursor)
