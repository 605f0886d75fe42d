"""Preemption and draining in the scheduler (contract §12): the victim choice as a plain
function, then whole scheduler passes over a real database (PostgreSQL and SQLite): jobs
placed by the pass, started through the workers' own claim, ended through their own report."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from service.db import Database
from service.hosts import service as hosts_service
from service.jobs import repository as jobs_repo
from service.jobs.lifecycle import claim_node, end_attempt, finish_node
from service.jobs.states import lock_job
from service.models import GpuAllocation, Job, JobEvent, User
from service.nodes.values import NodeOutcome
from service.scheduler.placement_pass import run_pass
from service.scheduler.preemption import RunningJob, choose_victims
from service.states import JobState, NodeState
from tests.factories import make_job, make_user, make_worker

# -- the choice, as a plain function -----------------------------------------------------------


def running(id_: int, priority: int = 0, owner: int = 1, started: float = 0.0, **slots: int) -> RunningJob:
    return RunningJob(id=id_, priority=priority, owner=owner, started=started, slots=slots or {"a": 1})


def choose(
    priority: int, need: tuple[int, int], free: dict[str, int], jobs: list[RunningJob]
) -> list[int] | None:
    held: dict[int, int] = {}
    for j in jobs:
        held[j.owner] = held.get(j.owner, 0) + sum(j.slots.values())
    chosen = choose_victims(
        priority=priority, nodes=need[0], gpus_per_node=need[1], free=free, running=jobs, held=held
    )
    return None if chosen is None else sorted(j.id for j in chosen)


def test_the_fewest_victims_even_of_a_higher_priority() -> None:
    """One job of priority 1 holding 2 GPUs beats two of priority 0 holding 1 each."""
    jobs = [running(1, 0, a=1), running(2, 0, a=1), running(3, 1, a=2)]
    assert choose(5, (1, 2), {"a": 0}, jobs) == [3]


def test_lowest_priority_then_the_biggest_holder_then_the_latest_start() -> None:
    assert choose(5, (1, 1), {"a": 0}, [running(1, 2), running(2, 1), running(3, 3)]) == [2]
    # owner 7 holds 3 GPUs, owner 8 one: owner 7's job goes, though it started later... or earlier
    jobs = [
        running(1, 0, owner=8, started=9),
        running(2, 0, owner=7, started=1, a=1),
        running(4, 0, owner=7, b=2),
    ]
    assert choose(5, (1, 1), {"a": 0}, jobs) == [2]
    jobs = [running(1, 0, started=1), running(2, 0, started=3), running(3, 0, started=2)]
    assert choose(5, (1, 1), {"a": 0}, jobs) == [2]


def test_never_equal_priority_nor_a_job_that_is_not_preemptible() -> None:
    assert choose(0, (1, 1), {"a": 0}, [running(1, 0)]) is None
    pinned = RunningJob(id=1, priority=0, owner=1, started=0, slots={"a": 1}, preemptible=False)
    assert choose(5, (1, 1), {"a": 0}, [pinned]) is None
    stopping = RunningJob(id=1, priority=0, owner=1, started=0, slots={"a": 1}, stopping=True)
    assert choose(5, (1, 1), {"a": 0}, [stopping]) is None


def test_nothing_when_even_every_candidate_would_not_make_it_fit() -> None:
    """A 2-node job with one usable host: preempting everything there does not help."""
    assert choose(5, (2, 1), {"a": 0}, [running(1, 0), running(2, 0)]) is None
    # GPUs on a host the job may not use (not in `free`) do not count
    assert choose(5, (1, 1), {"a": 0}, [running(1, 0, b=1)]) is None


def test_victims_on_several_hosts_for_a_multi_node_job() -> None:
    jobs = [running(1, 0, a=1), running(2, 0, b=1), running(3, 0, c=1)]
    assert choose(5, (2, 2), {"a": 1, "b": 1, "c": 0}, jobs) == [1, 2]


# -- whole passes over a real database -----------------------------------------------------------


def submit(db: Database, owner: int, **fields: Any) -> int:
    with db.transaction() as s:
        return make_job(s, owner, "queued", mode="ddp", **fields).id


def schedule(db: Database) -> None:
    run_pass(db, db.settings, dispatch=lambda _: None)


def start(db: Database, job_id: int) -> None:
    """The workers claim every pending node of the job's attempt (then it is running)."""
    with db.transaction() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.state == JobState.SCHEDULED, (job_id, job and job.state)
        for run in jobs_repo.runs_of(s, job_id, job.attempt):
            assert claim_node(s, job_id, job.attempt, run.node_rank, f"{run.worker_name}-session") is not None


def stop_nodes(db: Database, job_id: int) -> None:
    """Every node of the attempt reports what a supervisor reports after a preemption stop."""
    with db.transaction() as s:
        job = s.get(Job, job_id)
        assert job is not None
        attempt = job.attempt
        for run in jobs_repo.runs_of(s, job_id, attempt):
            finish_node(
                s, job_id, attempt, run.node_rank, NodeOutcome(state=NodeState.LOST, error="preempted")
            )


def job(db: Database, job_id: int) -> Job:
    with db.read() as s:
        row = s.get(Job, job_id)
        assert row is not None
        s.expunge(row)
        return row


def events(db: Database, job_id: int, type_: str) -> list[dict[str, Any]]:
    with db.read() as s:
        rows = s.execute(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == type_)).scalars()
        return [dict(e.data) for e in rows]


def allocations(db: Database, job_id: int) -> int:
    with db.read() as s:
        return len(s.execute(select(GpuAllocation).where(GpuAllocation.job_id == job_id)).all())


def users(db: Database, *names: str, quota: int | None = None) -> list[int]:
    with db.transaction() as s:
        made = [make_user(s, n) for n in names]
        for u in made:
            u.gpu_quota = quota
        return [u.id for u in made]


def run_two_low_jobs(db: Database, owner: int) -> tuple[int, int]:
    with db.transaction() as s:
        make_worker(s, "w0", gpus=2)
    first = submit(db, owner, priority=0)
    schedule(db)
    start(db, first)
    second = submit(db, owner, priority=0)
    schedule(db)
    start(db, second)
    return first, second


def test_a_higher_priority_preempts_once_and_is_placed_once_the_gpus_are_free(db: Database) -> None:
    alice, bob = users(db, "alice", "bob")
    first, second = run_two_low_jobs(db, alice)
    later = submit(db, alice, priority=0)  # submitted after the victim: must stay behind it
    high = submit(db, bob, priority=5)
    schedule(db)
    # the most recently started of the two is chosen, and only it
    assert job(db, second).preempting_since is not None and job(db, first).preempting_since is None
    assert events(db, second, "preempted") == [{"by_priority": 5, "by_job": high}]
    # its GPU is still its own: the preemptor waits, named as waiting for it
    assert job(db, high).state == JobState.QUEUED and allocations(db, second) == 1
    assert "preempt" in (job(db, high).pending_reason or "")
    for _ in range(3):  # passes while the victim drains preempt nobody else
        schedule(db)
    assert job(db, first).preempting_since is None and job(db, high).state == JobState.QUEUED
    assert len(events(db, second, "preempted")) == 1

    stop_nodes(db, second)
    victim = job(db, second)
    assert (victim.state, victim.attempt, victim.free_attempts) == (JobState.QUEUED, 2, 1)
    with db.read() as s:
        reasons = [a.reason for a in jobs_repo.attempts_for(s, {second})]
        positions = jobs_repo.queue_positions(s, [s.get(Job, second), s.get(Job, later)])  # type: ignore[list-item]
    assert reasons == ["preempted"]
    assert positions[second] < positions[later]  # it kept its place in the queue
    schedule(db)
    assert job(db, high).state == JobState.SCHEDULED
    assert job(db, second).state == JobState.QUEUED  # equal to the running one: preempts nothing
    assert job(db, first).preempting_since is None


def test_equal_priority_and_pinned_jobs_are_never_preempted(db: Database) -> None:
    (alice,) = users(db, "alice")
    with db.transaction() as s:
        make_worker(s, "w0", gpus=2)
    pinned = submit(db, alice, priority=0, preemptible=False)
    schedule(db)
    start(db, pinned)
    peer = submit(db, alice, priority=3)
    schedule(db)
    start(db, peer)
    same = submit(db, alice, priority=3)
    schedule(db)
    assert job(db, peer).preempting_since is None and job(db, pinned).preempting_since is None
    assert job(db, same).state == JobState.QUEUED


def test_an_owner_at_quota_preempts_nothing(db: Database) -> None:
    (alice,) = users(db, "alice")
    (bob,) = users(db, "bob", quota=1)
    with db.transaction() as s:
        make_worker(s, "w0", gpus=2)
    low = submit(db, alice, priority=0)
    schedule(db)
    start(db, low)
    bobs = submit(db, bob, priority=1)
    schedule(db)
    start(db, bobs)
    over = submit(db, bob, priority=9)
    schedule(db)
    assert job(db, low).preempting_since is None
    assert "gpu_quota" in (job(db, over).pending_reason or "")


def test_a_preemption_is_not_charged_to_max_retries(db: Database) -> None:
    (alice,) = users(db, "alice")
    first, second = run_two_low_jobs(db, alice)
    with db.transaction() as s:  # the second may be retried once after an infrastructure failure
        row = lock_job(s, second)
        assert row is not None
        row.max_retries = 1
    high = submit(db, alice, priority=5, gpus_per_node=2)  # needs both: both are preempted
    schedule(db)
    assert job(db, first).preempting_since is not None and job(db, second).preempting_since is not None
    stop_nodes(db, first)
    stop_nodes(db, second)
    schedule(db)
    start(db, high)
    with db.transaction() as s:
        finish_node(s, high, 1, 0, NodeOutcome(state=NodeState.SUCCEEDED, exit_code=0))
    schedule(db)
    for victim in (first, second):
        start(db, victim)
        with db.transaction() as s:  # its second attempt fails on the infrastructure
            row = lock_job(s, victim)
            assert row is not None and row.attempt == 2
            end_attempt(s, row, None, "worker lost", retryable=True)
    assert job(db, first).state == JobState.FAILED  # max_retries 0: the preemption used none
    assert job(db, second).state == JobState.QUEUED  # max_retries 1: its one retry, still there


def test_drain_stops_every_job_there_and_readmit_ends_it(db: Database) -> None:
    (alice,) = users(db, "alice")
    with db.transaction() as s:
        make_worker(s, "w0", gpus=2)
        make_worker(s, "w1", gpus=1)
    pinned = submit(db, alice, priority=0, preemptible=False, gpus_per_node=2)
    schedule(db)
    start(db, pinned)
    with db.transaction() as s:
        assert hosts_service.drain_worker(s, "w0").state == "draining"
        assert hosts_service.drain_worker(s, "w0").state == "draining"  # idempotent
    schedule(db)
    assert events(db, pinned, "preempted") == [{"by_priority": None, "drained": "w0"}]
    stop_nodes(db, pinned)
    fresh = submit(db, alice, priority=0)
    schedule(db)
    # the stopped job cannot go back there; the new one is placed on w1, never on w0
    with db.read() as s:
        placed = {a.worker_name for a in s.execute(select(GpuAllocation)).scalars()}
        states = {w.name: w.state for w in hosts_service.list_workers(s, None).items}
    assert placed == {"w1"} and job(db, fresh).state == JobState.SCHEDULED
    assert states == {"w0": "drained", "w1": "online"}
    assert job(db, pinned).state == JobState.QUEUED
    with db.transaction() as s:
        assert hosts_service.readmit_worker(s, "w0").state == "online"
    schedule(db)
    assert job(db, pinned).state == JobState.SCHEDULED


def test_the_preemptors_id_is_shown_to_its_owner_and_the_admin_only(db: Database) -> None:
    from service.jobs.preemption import redact
    from service.jobs.schemas import EventOut

    alice, bob = users(db, "alice", "bob")
    first, second = run_two_low_jobs(db, alice)
    high = submit(db, bob, priority=5)
    mine = submit(db, alice, priority=4)
    schedule(db)  # bob's job preempts one of alice's; alice's own job of priority 4 the other
    with db.read() as s:
        viewers = {u.name: u for u in s.execute(select(User)).scalars()}
        admin = User(name="root", token_hash="x", is_admin=True)
        for victim in (first, second):
            seen = {}
            for name, viewer in (("alice", viewers["alice"]), ("admin", admin), ("stream", None)):
                out = [EventOut.model_validate(e) for e in jobs_repo.events_after(s, victim, 0, 100)]
                data = [e.data for e in redact(s, viewer, victim, out) if e.type == "preempted"]
                seen[name] = data[0]
            by = events(db, victim, "preempted")[0]["by_job"]
            assert seen["admin"]["by_job"] == by
            if by == mine:
                assert seen["alice"]["by_job"] == mine and seen["stream"]["by_job"] == mine
            else:
                assert by == high and "by_job" not in seen["alice"] and "by_job" not in seen["stream"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop_grace_s", 0),
        ("stop_grace_s", 86401),
        ("stop_grace_s", "60"),
        ("stop_grace_s", None),
        ("preemptible", "no"),
    ],
)
def test_bad_preemption_fields_are_refused_naming_the_field(field: str, value: object) -> None:
    from pydantic import ValidationError

    from service.jobs.spec import JobSpec

    base = {"mode": "single", "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "digits"}}
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({**base, field: value})
    assert {e["loc"][0] for e in err.value.errors()} == {field}
    spec = JobSpec.model_validate(base)
    assert (spec.preemptible, spec.stop_grace_s) == (True, 120)


def test_a_lost_node_while_preempted_ends_as_one_preemption(db: Database) -> None:
    """The victim's worker dies during the grace: the reaper's verdict on the node settles the
    same preemption (queued again, not charged, not failed with max_retries 0), once."""
    from service.hosts.states import take_offline
    from service.models import Worker

    (alice,) = users(db, "alice")
    first, second = run_two_low_jobs(db, alice)
    submit(db, alice, priority=5)
    schedule(db)
    with db.transaction() as s:
        worker = s.get(Worker, "w0")
        assert worker is not None and take_offline(worker)
    schedule(db)  # the reaper loses both jobs' nodes
    victim, other = job(db, second), job(db, first)
    assert (victim.state, victim.attempt, victim.free_attempts) == (JobState.QUEUED, 2, 1)
    assert other.state == JobState.FAILED  # not preempted: an ordinary lost node, max_retries 0
    with db.read() as s:
        assert [a.reason for a in jobs_repo.attempts_for(s, {second})] == ["preempted"]
    assert len(events(db, second, "preempted")) == 1
