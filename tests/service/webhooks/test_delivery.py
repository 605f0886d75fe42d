"""Sending, on SQLite and PostgreSQL, to a real HTTP receiver on 127.0.0.1: the dispatcher
thread delivers each event signed, once, in order per job, retrying what failed; redirects are
not followed; the target is checked again at each send and the checked address is the one
connected to; a delivery is given up once its window has passed (an injected clock)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import select

from service.config import Settings
from service.db import Database
from service.jobs.schemas import EventOut
from service.models import JobEvent, Webhook, WebhookAttempt, WebhookDelivery, utcnow
from service.testing.harness import wait_for
from service.webhooks.delivery import Sender
from service.webhooks.dispatcher import WebhookDispatcher, claim
from service.webhooks.outbox import events_column
from tests.factories import make_job, make_user, move_job, set_job_state
from tests.service.webhooks.receiver import Receiver

SECRET = "a-secret-of-some-length"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def register(db: Database, url: str, events: tuple[str, ...] = ("state",)) -> int:
    with db.transaction() as s:
        alice = make_user(s, "alice")
        s.add(
            Webhook(owner_id=alice.id, url=url, events=events_column(events), secret=SECRET, all_jobs=False)
        )
        return alice.id


def events_as_served(db: Database, job_id: int) -> list[dict]:
    """What GET /v1/jobs/{id}/events shows, for comparison."""
    with db.read() as s:
        rows = s.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)).scalars()
        return [EventOut.model_validate(e).model_dump(mode="json") for e in rows]


def deliveries(db: Database) -> list[WebhookDelivery]:
    with db.read() as s:
        return list(s.execute(select(WebhookDelivery).order_by(WebhookDelivery.id)).scalars())


def one_delivery(db: Database, sender: Sender) -> None:
    ids = claim(db, sender.settings, 1, sender.clock)
    assert len(ids) == 1
    assert sender.deliver(ids[0]) is not None


def test_the_dispatcher_delivers_every_event_signed_once_in_order(settings: Settings, db: Database) -> None:
    receiver = Receiver(fail_first=3).start()  # the first three calls are answered 500
    try:
        owner = register(db, receiver.url)
        with db.transaction() as s:
            jobs = [make_job(s, owner, "running") for _ in range(3)]  # three state events each
            job_ids = [j.id for j in jobs]
        dispatcher = WebhookDispatcher(db, settings)
        dispatcher.start()
        try:
            wait_for(lambda: len(receiver.delivered()) >= 9, 60, "nine deliveries")
            with db.transaction() as s:
                for job_id in job_ids:  # more events later: they follow
                    set_job_state(s, job_id, "succeeded")
            wait_for(lambda: len(receiver.delivered()) >= 12, 60, "twelve deliveries")
        finally:
            dispatcher.stop()
            dispatcher.join(timeout=30)
        assert not dispatcher.is_alive()
    finally:
        receiver.stop()
    assert [c.status for c in receiver.calls[:3]] == [500, 500, 500]
    for job_id in job_ids:
        served = events_as_served(db, job_id)
        got = [json.loads(c.body) for c in receiver.delivered() if json.loads(c.body)["job_id"] == job_id]
        assert [g["event"] for g in got] == served  # every state event, in seq order, once
        calls = [c for c in receiver.calls if json.loads(c.body)["job_id"] == job_id]
        assert [json.loads(c.body)["event"]["seq"] for c in calls] == sorted(
            json.loads(c.body)["event"]["seq"] for c in calls
        )  # never an event before the one ahead of it was accepted
    for call in receiver.calls:
        assert call.verifies(SECRET), call.headers
        body = json.loads(call.body)
        assert call.headers["x-torchjobs-event-id"] == f"{body['job_id']}:{body['event']['seq']}"
        assert call.headers["x-torchjobs-event"] == "state" and call.path == "/hook"
    retried = [
        c
        for c in receiver.calls
        if c.headers["x-torchjobs-event-id"] == receiver.calls[0].headers["x-torchjobs-event-id"]
    ]
    assert len({c.body for c in retried}) == 1  # the same bytes, the same signature, each time
    rows = deliveries(db)
    assert len(rows) == 12 and {r.status for r in rows} == {"delivered"}
    assert sum(r.attempts for r in rows) == len(receiver.calls) == 15
    with db.read() as s:
        codes = s.execute(select(WebhookAttempt.status_code).order_by(WebhookAttempt.id)).scalars().all()
    assert sorted(codes) == [200] * 12 + [500] * 3


def test_a_redirect_is_a_failure_and_is_not_followed(settings: Settings, db: Database) -> None:
    elsewhere = Receiver().start()
    redirecting = Receiver(status=302, location=elsewhere.url).start()
    try:
        owner = register(db, redirecting.url)
        with db.transaction() as s:
            make_job(s, owner)
        sender = Sender(db, settings)
        one_delivery(db, sender)
        sender.close()
    finally:
        redirecting.stop()
        elsewhere.stop()
    [row] = deliveries(db)
    assert (row.status, row.attempts, row.last_status_code) == ("pending", 1, 302)
    assert "redirects are not followed" in (row.last_error or "")
    assert len(redirecting.calls) == 1 and elsewhere.calls == []


def resolving(name: str, address: str):  # type: ignore[no-untyped-def]
    def resolver(host: str, port: int, **_kw: object) -> list[tuple]:
        assert host == name
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    return resolver


def test_a_name_that_now_resolves_to_a_private_address_is_not_sent_to(
    settings: Settings, db: Database, receiver: Receiver
) -> None:
    """Registered when it was public; at the send, DNS says 127.0.0.1: refused, nothing sent."""
    strict = settings.model_copy(update={"webhook_allow_private": False})
    owner = register(db, f"http://hooks.test:{receiver.port}/hook")
    with db.transaction() as s:
        make_job(s, owner)
    sender = Sender(db, strict, resolver=resolving("hooks.test", "127.0.0.1"))
    one_delivery(db, sender)
    sender.close()
    [row] = deliveries(db)
    assert row.status == "pending" and row.last_status_code is None
    assert "not sent" in (row.last_error or "") and "127.0.0.1" in (row.last_error or "")
    assert receiver.calls == []


def test_a_name_that_does_not_resolve_is_a_failed_attempt_kept_for_retry(
    settings: Settings, db: Database, receiver: Receiver
) -> None:
    """Registration takes a name that does not resolve yet (contract §10 refuses only private
    targets); each send checks it again, and no address is a failed attempt, still pending."""

    def nowhere(host: str, port: int, **_kw: object) -> list[tuple]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    owner = register(db, f"http://later.test:{receiver.port}/hook")
    with db.transaction() as s:
        make_job(s, owner)
    sender = Sender(db, settings, resolver=nowhere)
    one_delivery(db, sender)
    sender.close()
    [row] = deliveries(db)
    assert row.status == "pending" and row.last_status_code is None
    assert "does not resolve" in (row.last_error or "")
    assert receiver.calls == []


def test_the_address_checked_is_the_one_connected_to(
    settings: Settings, db: Database, receiver: Receiver
) -> None:
    """No second lookup between the check and the connection; the Host header keeps the name."""
    owner = register(db, f"http://hooks.test:{receiver.port}/hook?x=1")
    with db.transaction() as s:
        make_job(s, owner)
    sender = Sender(db, settings, resolver=resolving("hooks.test", "127.0.0.1"))
    one_delivery(db, sender)
    sender.close()
    [call] = receiver.calls
    assert call.headers["host"] == f"hooks.test:{receiver.port}" and call.path == "/hook?x=1"
    assert deliveries(db)[0].status == "delivered"


def test_given_up_after_the_window_then_the_next_event_proceeds(settings: Settings, db: Database) -> None:
    down = Receiver(fail_first=1000).start()
    try:
        owner = register(db, down.url)
        with db.transaction() as s:
            move_job(s, make_job(s, owner), "scheduled")  # events 1 and 2
        on_time = Sender(db, settings)
        one_delivery(db, on_time)  # a 500 within the window: tried again later
        on_time.close()
        [first, second] = deliveries(db)
        assert (first.status, first.attempts, second.status) == ("pending", 1, "pending")
        assert first.next_attempt_at > first.created_at
        a_day_later = Sender(
            db, settings, clock=lambda: utcnow() + timedelta(seconds=settings.webhook_retry_for_s + 1)
        )
        one_delivery(db, a_day_later)  # its window has passed: given up
        [first, second] = deliveries(db)
        assert (first.status, first.attempts, first.last_status_code) == ("failed", 2, 500)
        one_delivery(db, a_day_later)  # the next event is not held back by it
        a_day_later.close()
    finally:
        down.stop()
    seqs = [json.loads(c.body)["event"]["seq"] for c in down.calls]
    assert seqs == [1, 1, 2]
