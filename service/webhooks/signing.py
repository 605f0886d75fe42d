"""The bytes a receiver gets and how it knows they are ours (contract §10).

The body is `{"job_id": J, "event": EVENT}` as compact ASCII JSON, EVENT exactly as
`GET /v1/jobs/{id}/events` shows it; rendered from the stored event at every attempt, it is the
same bytes each time, and so is its signature: `X-Torchjobs-Signature: sha256=HEX`, the
HMAC-SHA256 of those bytes keyed with the webhook's secret. `X-Torchjobs-Event-Id: J:SEQ` is the
same on every attempt too: a receiver that remembers it never acts on one event twice.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SIGNATURE_HEADER = "X-Torchjobs-Signature"
EVENT_ID_HEADER = "X-Torchjobs-Event-Id"
EVENT_TYPE_HEADER = "X-Torchjobs-Event"


def render_body(job_id: int, event: dict[str, Any]) -> bytes:
    """`event` is an Event in its JSON form (`EventOut.model_dump(mode="json")`)."""
    return json.dumps({"job_id": job_id, "event": event}, separators=(",", ":"), ensure_ascii=True).encode()


def signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, header: str | None) -> bool:
    """What a receiver does (shown in docs/guide.md): compare in constant time."""
    return header is not None and hmac.compare_digest(signature(secret, body), header)


def event_id(job_id: int, seq: int) -> str:
    return f"{job_id}:{seq}"


def headers(secret: str, body: bytes, job_id: int, seq: int, type_: str) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        EVENT_ID_HEADER: event_id(job_id, seq),
        EVENT_TYPE_HEADER: type_,
        SIGNATURE_HEADER: signature(secret, body),
    }
