"""The signed body, and when a failed delivery is tried again or given up (an injected clock)."""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import UTC, datetime, timedelta

import pytest

from service.webhooks.backoff import RetryPolicy
from service.webhooks.delivery import DELIVERED, FAILED, PENDING, Outcome, judge
from service.webhooks.signing import event_id, headers, render_body, signature, verify

EVENT = {
    "seq": 7,
    "ts": "2026-01-02T03:04:05.123456Z",
    "type": "state",
    "data": {"state": "running", "reason": "é"},
}
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_the_body_is_the_same_bytes_every_time_and_its_signature_verifies() -> None:
    body = render_body(42, EVENT)
    assert body == render_body(42, json.loads(json.dumps(EVENT)))
    assert json.loads(body) == {"job_id": 42, "event": EVENT}
    assert body.isascii() and b": " not in body and b", " not in body  # compact, ASCII
    expected = hmac.new(b"k" * 16, body, hashlib.sha256).hexdigest()
    assert signature("k" * 16, body) == f"sha256={expected}"
    assert verify("k" * 16, body, f"sha256={expected}")
    assert not verify("x" * 16, body, f"sha256={expected}")
    assert not verify("k" * 16, body + b" ", f"sha256={expected}")
    assert not verify("k" * 16, body, None)
    sent = headers("k" * 16, body, 42, 7, "state")
    assert sent["X-Torchjobs-Event-Id"] == event_id(42, 7) == "42:7"
    assert sent["X-Torchjobs-Signature"] == f"sha256={expected}"
    assert sent["Content-Type"] == "application/json"


def test_the_wait_grows_exponentially_with_jitter_and_is_capped() -> None:
    policy = RetryPolicy(initial_s=1.0, max_s=300.0, retry_for_s=3600)
    for failures in range(1, 30):
        top = min(300.0, 2.0 ** (failures - 1))
        waits = [policy.wait_s(failures) for _ in range(50)]
        assert all(top / 2 <= w <= top for w in waits), (failures, min(waits), max(waits))
        if failures > 2:
            assert len(set(waits)) > 1  # jittered
    assert policy.wait_s(1000) <= 300.0


def test_a_failed_try_is_retried_until_the_window_has_passed_then_given_up() -> None:
    policy = RetryPolicy(initial_s=1.0, max_s=300.0, retry_for_s=3600)
    down = Outcome(503, "HTTP 503", 12)
    no_answer = Outcome(None, "ConnectError (1.1.1.1): refused", 3)
    now = T0
    failures = 0
    while True:
        verdict = judge(down if failures % 2 else no_answer, failures, T0, now, policy)
        failures += 1
        if verdict.status != PENDING:
            break
        assert now < T0 + timedelta(hours=1)
        assert timedelta(0) < verdict.next_attempt_at - now <= timedelta(seconds=300)
        now = verdict.next_attempt_at
    assert verdict.status == FAILED and now >= T0 + timedelta(hours=1)  # tried for at least the hour
    assert now < T0 + timedelta(hours=1, seconds=301)
    assert failures > 10


def test_a_2xx_is_delivered_whenever_it_comes() -> None:
    policy = RetryPolicy(initial_s=1.0, max_s=300.0, retry_for_s=3600)
    late = T0 + timedelta(days=2)
    for code in (200, 201, 204, 299):
        verdict = judge(Outcome(code, None, 5), 40, T0, late, policy)
        assert (verdict.status, verdict.delivered_at) == (DELIVERED, late)
    for code in (199, 301, 304, 400, 404, 500):
        assert judge(Outcome(code, f"HTTP {code}", 5), 0, T0, T0, policy).status == PENDING


def test_an_event_that_is_gone_is_given_up_at_once() -> None:
    policy = RetryPolicy(initial_s=1.0, max_s=300.0, retry_for_s=3600)
    assert judge(Outcome(None, "gone", 0, final=True), 0, T0, T0, policy).status == FAILED


def test_the_retry_window_has_a_floor_of_an_hour() -> None:
    from pydantic import ValidationError

    from service.config import Settings

    with pytest.raises(ValidationError):
        Settings(webhook_retry_for_s=600)
    assert Settings().webhook_retry_for_s >= 3600
