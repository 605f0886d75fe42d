"""The outbox on SQLite and PostgreSQL: an event is queued in its own transaction for every
webhook that wants it; the dispatcher leases one head per (webhook, job), in `seq` order; a
lease is a compare-and-set that concurrent claimers never share."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta

import pytest
from sqlalchemy import select, true

from service.config import Settings
from service.db import Database
from service.jobs.service import new_job
from service.jobs.spec import JobSpec
from service.jobs.states import WriteGuard, append_event, append_events, create_job_if
from service.models import Webhook, WebhookDelivery, utcnow
from service.webhooks import repository as repo
from service.webhooks.dispatcher import claim
from service.webhooks.outbox import events_column
from tests.factories import make_job, make_user, move_job

LEASE = timedelta(seconds=60)


def add_hook(s, owner_id: int, events: Sequence[str] = ("state",), all_jobs: bool = False) -> int:  # type: ignore[no-untyped-def]
    hook = Webhook(
        owner_id=owner_id,
        url="http://127.0.0.1:9/",
        events=events_column(events),
        secret="s" * 16,
        all_jobs=all_jobs,
    )
    s.add(hook)
    s.flush()
    return hook.id


def queued(db: Database) -> list[tuple[int, int, int, str]]:
    with db.read() as s:
        rows = s.execute(
            select(
                WebhookDelivery.webhook_id,
                WebhookDelivery.job_id,
                WebhookDelivery.seq,
                WebhookDelivery.status,
            ).order_by(WebhookDelivery.webhook_id, WebhookDelivery.job_id, WebhookDelivery.seq)
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def seqs_of(db: Database, ids: list[int]) -> list[tuple[int, int]]:
    with db.read() as s:
        rows = s.execute(
            select(WebhookDelivery.job_id, WebhookDelivery.seq).where(WebhookDelivery.id.in_(ids))
        ).all()
    return sorted((r.job_id, r.seq) for r in rows)


def settle(db: Database, delivery_id: int, status: str, next_in: timedelta = timedelta(0)) -> None:
    now = utcnow()
    with db.transaction() as s:
        assert repo.record(
            s,
            delivery_id,
            at=now,
            status_code=200 if status == "delivered" else 500,
            error=None,
            duration_ms=1,
            status=status,
            next_attempt_at=now + next_in,
            delivered_at=now if status == "delivered" else None,
        )


def test_each_event_is_queued_for_every_webhook_that_wants_it(db: Database) -> None:
    with db.transaction() as s:
        alice, bob = make_user(s, "alice"), make_user(s, "bob")
        admin = make_user(s, "admin", is_admin=True)
        a_state = add_hook(s, alice.id)
        a_other = add_hook(s, alice.id, ("checkpoint", "progress"))
        add_hook(s, bob.id)  # bob's: never alice's jobs
        admin_all = add_hook(s, admin.id, ("state",), all_jobs=True)
        add_hook(s, admin.id, ("state", "progress"))  # the admin's own jobs only
        job = make_job(s, alice.id, "running")  # state events 1, 2, 3
        append_events(s, job.id, [("progress", {"step": 1}), ("progress", {"step": 2})])  # 4, 5
        append_event(s, job.id, "checkpoint", {"id": 1})  # 6
        append_event(s, job.id, "stall", {"rank": 0})  # 7: nobody asked
        j = job.id
    assert queued(db) == sorted(
        [(a_state, j, seq, "pending") for seq in (1, 2, 3)]
        + [(a_other, j, seq, "pending") for seq in (4, 5, 6)]
        + [(admin_all, j, seq, "pending") for seq in (1, 2, 3)]
    )


def test_a_job_written_in_one_statement_queues_its_first_event_as_create_job_does(db: Database) -> None:
    """`create_job_if` (`POST /v1/jobs`: on PostgreSQL the deliveries are a CTE of the job's
    INSERT) queues the first event for exactly the webhooks `create_job` queues it for."""
    spec = JobSpec.model_validate({"mode": "single", "entrypoint": {"kind": "builtin", "model": "mlp"}})
    with db.transaction() as s:
        alice, bob = make_user(s, "alice"), make_user(s, "bob")
        admin = make_user(s, "admin", is_admin=True)
        a_state = add_hook(s, alice.id)
        add_hook(s, alice.id, ("checkpoint", "progress"))
        add_hook(s, bob.id)
        admin_all = add_hook(s, admin.id, ("state",), all_jobs=True)
        add_hook(s, admin.id, ("state", "progress"))
        job = new_job(s, alice, spec, None, None)
        assert create_job_if(s, job, WriteGuard(true()), {}) == 1
        fast = job.id
        slow = make_job(s, alice.id).id
    wanted = [(hook, j, 1, "pending") for hook in (a_state, admin_all) for j in (fast, slow)]
    assert queued(db) == sorted(wanted)


def test_nothing_is_queued_without_a_webhook_nor_for_a_rolled_back_event(db: Database) -> None:
    with db.transaction() as s:
        alice = make_user(s, "alice")
        make_job(s, alice.id, "running")
        alice_id = alice.id
    assert queued(db) == []
    with db.transaction() as s:
        add_hook(s, alice_id)

    def a_job_then_a_failure() -> None:
        with db.transaction() as s:
            make_job(s, alice_id)
            raise RuntimeError("the writer's transaction fails after the event")

    with pytest.raises(RuntimeError, match="the writer's transaction fails"):
        a_job_then_a_failure()
    assert queued(db) == []


def test_one_head_per_webhook_and_job_in_seq_order(db: Database) -> None:
    with db.transaction() as s:
        alice = make_user(s, "alice")
        add_hook(s, alice.id)
        first, second = make_job(s, alice.id, "running"), make_job(s, alice.id)  # 3 events; 1
        first_id, second_id = first.id, second.id
    now = utcnow()
    with db.transaction() as s:
        heads = repo.claim_due(s, now, 10, now + LEASE)
    assert seqs_of(db, heads) == [(first_id, 1), (second_id, 1)]
    with db.transaction() as s:
        assert repo.claim_due(s, now, 10, now + LEASE) == []  # leased, and the rest wait behind them
    by_job = dict(zip([first_id, second_id], heads, strict=True))
    settle(db, by_job[first_id], "delivered")
    settle(db, by_job[second_id], "delivered")  # the second job has no more
    with db.transaction() as s:
        nxt = repo.claim_due(s, utcnow(), 10, utcnow() + LEASE)
    assert seqs_of(db, nxt) == [(first_id, 2)]
    settle(db, nxt[0], "pending", next_in=timedelta(hours=1))  # failed: tried again in an hour
    with db.transaction() as s:
        assert repo.claim_due(s, utcnow(), 10, utcnow() + LEASE) == []  # seq 3 waits behind seq 2
    later = utcnow() + timedelta(hours=1, seconds=1)
    with db.transaction() as s:
        again = repo.claim_due(s, later, 10, later + LEASE)
    assert again == nxt
    settle(db, again[0], "failed")  # given up: the next event of that job proceeds
    with db.transaction() as s:
        assert seqs_of(db, repo.claim_due(s, utcnow(), 10, utcnow() + LEASE)) == [(first_id, 3)]


def test_a_lease_that_ran_out_is_taken_again(db: Database) -> None:
    with db.transaction() as s:
        alice = make_user(s, "alice")
        add_hook(s, alice.id)
        make_job(s, alice.id)
    now = utcnow()
    with db.transaction() as s:
        taken = repo.claim_due(s, now, 10, now + LEASE)
    with db.transaction() as s:
        assert repo.claim_due(s, now + LEASE / 2, 10, now + LEASE * 2) == []
    with db.transaction() as s:
        assert repo.claim_due(s, now + LEASE + timedelta(seconds=1), 10, now + LEASE * 3) == taken


def test_concurrent_claimers_never_share_a_delivery(settings: Settings, db: Database) -> None:
    with db.transaction() as s:
        alice = make_user(s, "alice")
        add_hook(s, alice.id)
        for _ in range(30):
            move_job(s, make_job(s, alice.id), "scheduled")  # two events each: one head
    claimers = [Database(settings) for _ in range(4)]
    start = threading.Barrier(len(claimers))
    got: list[list[int]] = [[] for _ in claimers]

    def run(i: int) -> None:
        start.wait()
        for _ in range(5):
            got[i] += claim(claimers[i], settings, 4)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(claimers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for c in claimers:
        c.dispose()
    everything = [d for ids in got for d in ids]
    assert len(everything) == len(set(everything)) == 30, got
    assert {seq for _job, seq in seqs_of(db, everything)} == {1}  # heads only
