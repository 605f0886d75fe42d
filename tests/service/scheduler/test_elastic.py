"""Elastic jobs (contract §12): `nodes: {min, max}` placed on as many nodes as fit, resized on a
lost node at once and grown back at a checkpoint. The placement as a plain function, then
whole scheduler passes over a real database (PostgreSQL and SQLite), the nodes started and
ended through the workers' own claim and reports, a host lost through the reaper's verdict."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from service.db import Database
from service.jobs import repository as jobs_repo
from service.jobs.lifecycle import finish_node
from service.models import Checkpoint, GpuAllocation, Job, Worker, utcnow
from service.nodes.values import NodeOutcome
from service.scheduler.placement import Host, Owner, QueuedJob, plan
from service.states import JobState, NodeState
from tests.factories import make_user, make_worker
from tests.service.scheduler.test_preemption import events, job, schedule, start, stop_nodes, submit

# -- the placement, as a plain function -----------------------------------------------------------


def hosts(*free: int) -> list[Host]:
    return [Host(name=f"h{i}", free=tuple(range(n))) for i, n in enumerate(free)]


def elastic(low: int, high: int, **fields: Any) -> QueuedJob:
    return QueuedJob(id=1, priority=0, nodes=low, max_nodes=high, gpus_per_node=1, **fields)


def test_an_elastic_job_takes_as_many_nodes_as_fit_up_to_its_most() -> None:
    assert len(plan([elastic(2, 3)], hosts(1, 1, 1, 1), 300).placements[1]) == 3
    assert len(plan([elastic(2, 3)], hosts(1, 1), 300).placements[1]) == 2
    waits = plan([elastic(2, 3)], hosts(1, 0, 0), 300)
    assert 1 not in waits.placements and waits.pending_reasons[1].startswith("needs 2 nodes")


def test_an_elastic_job_grows_no_further_than_its_owners_quota() -> None:
    owners = {0: Owner(name="alice", in_use=1, quota=3)}
    placed = plan([elastic(1, 4, owner=0)], hosts(1, 1, 1, 1), 300, owners)
    assert len(placed.placements[1]) == 2


# -- whole passes over a real database -------------------------------------------------------------


def one_slot_workers(db: Database, *names: str) -> None:
    with db.transaction() as s:
        for name in names:
            make_worker(s, name, gpus=1)


def submit_elastic(db: Database, low: int, high: int, **fields: Any) -> int:
    with db.transaction() as s:
        owner = make_user(s, f"user{low}{high}{len(fields)}").id
    job_id = submit(db, owner, nodes=low, nodes_min=low, nodes_max=high, **fields)
    return job_id


def worker_gone(db: Database, name: str) -> None:
    """What the reaper decides of a host whose heartbeats stopped (heartbeat_timeout_s ago)."""
    with db.transaction() as s:
        worker = s.get(Worker, name)
        assert worker is not None
        worker.last_heartbeat = utcnow() - timedelta(hours=2)


def end_live_nodes(db: Database, job_id: int, state: str = NodeState.LOST) -> None:
    with db.transaction() as s:
        row = s.get(Job, job_id)
        assert row is not None
        for run in jobs_repo.runs_of(s, job_id, row.attempt):
            if run.state == NodeState.RUNNING:
                finish_node(s, job_id, row.attempt, run.node_rank, NodeOutcome(state=state, error="stopped"))


def hosts_of(db: Database, job_id: int) -> list[str]:
    with db.read() as s:
        row = s.get(Job, job_id)
        assert row is not None
        return sorted(r.worker_name for r in jobs_repo.runs_of(s, job_id, row.attempt))


def attempt_reasons(db: Database, job_id: int) -> list[str | None]:
    with db.read() as s:
        return [a.reason for a in jobs_repo.attempts_for(s, {job_id})]


@pytest.fixture(autouse=True)
def _heartbeats_judged(db: Database) -> None:
    db.settings.heartbeat_timeout_s = 60


def test_a_lost_node_resizes_the_job_onto_the_survivors_without_a_retry(db: Database) -> None:
    one_slot_workers(db, "a", "b", "c")
    job_id = submit_elastic(db, 2, 3, max_retries=0)
    schedule(db)
    assert hosts_of(db, job_id) == ["a", "b", "c"] and job(db, job_id).nodes == 3
    start(db, job_id)

    worker_gone(db, "c")
    schedule(db)  # the reaper loses c's node: the others are asked to stop, with a short grace
    stopping = job(db, job_id)
    assert stopping.state == JobState.RUNNING and stopping.resize_reason == "node lost"
    assert jobs_repo.stop_grace_of(stopping.preempting_since, 120, stopping.resize_reason) == 10
    end_live_nodes(db, job_id)
    queued = job(db, job_id)
    assert (queued.state, queued.attempt, queued.free_attempts) == (JobState.QUEUED, 2, 1)
    schedule(db)
    assert hosts_of(db, job_id) == ["a", "b"] and job(db, job_id).nodes == 2
    assert events(db, job_id, "resize") == [{"from": 3, "to": 2, "reason": "node lost"}]
    assert attempt_reasons(db, job_id)[0] == "resized"
    start(db, job_id)
    end_live_nodes(db, job_id, NodeState.SUCCEEDED)
    assert job(db, job_id).state == JobState.SUCCEEDED


def test_below_its_fewest_nodes_it_waits_in_the_queue(db: Database) -> None:
    one_slot_workers(db, "a", "b")
    job_id = submit_elastic(db, 2, 2)
    schedule(db)
    start(db, job_id)
    worker_gone(db, "b")
    schedule(db)
    end_live_nodes(db, job_id)
    schedule(db)
    waiting = job(db, job_id)
    assert waiting.state == JobState.QUEUED and "needs 2 nodes" in (waiting.pending_reason or "")


def node_0_fails(db: Database, job_id: int, exit_code: int, error: str) -> None:
    """Node 0 of attempt 1 reports a (retryable) failure, as its supervisor would."""
    outcome = NodeOutcome(state=NodeState.FAILED, exit_code=exit_code, error=error, retryable=True)
    with db.transaction() as s:
        finish_node(s, job_id, 1, 0, outcome)


def test_a_peer_failing_first_is_held_until_the_lost_host_is_known(db: Database) -> None:
    """Its peers' collectives fail at once; the host is known lost only when its heartbeats
    stop. The failure waits for that verdict: a resize, not a failed job."""
    one_slot_workers(db, "a", "b", "c")
    job_id = submit_elastic(db, 2, 3, max_retries=0)
    schedule(db)
    start(db, job_id)
    node_0_fails(db, job_id, 1, "peer gone")
    held = job(db, job_id)
    assert held.state == JobState.RUNNING and held.resize_reason == "node failed"
    worker_gone(db, "c")
    schedule(db)
    end_live_nodes(db, job_id)
    schedule(db)
    resized = job(db, job_id)
    assert resized.state == JobState.SCHEDULED and resized.error is None and resized.nodes == 2
    assert events(db, job_id, "resize") == [{"from": 3, "to": 2, "reason": "node lost"}]


def test_a_failure_with_no_lost_host_fails_as_it_would_have(db: Database) -> None:
    one_slot_workers(db, "a", "b")
    job_id = submit_elastic(db, 2, 2, max_retries=0)
    schedule(db)
    start(db, job_id)
    node_0_fails(db, job_id, 3, "bad step")
    end_live_nodes(db, job_id, NodeState.FAILED)
    failed = job(db, job_id)
    assert (failed.state, failed.exit_code, failed.error) == (JobState.FAILED, 3, "bad step")


def checkpoint(db: Database, job_id: int) -> None:
    with db.transaction() as s:
        row = s.get(Job, job_id)
        assert row is not None
        ckpt = Checkpoint(
            owner_id=row.owner_id,
            job_id=job_id,
            attempt=row.attempt,
            name="epoch_1.pt",
            size_bytes=1,
            sha256="0" * 64,
            storage_key=f"k{job_id}",
        )
        s.add(ckpt)


def running_on_two_of_three(db: Database) -> int:
    """An elastic job (2 to 3 nodes) running on two one-slot hosts, free to resize at once."""
    db.settings.resize_interval_s = 0
    one_slot_workers(db, "a", "b")
    job_id = submit_elastic(db, 2, 3)
    schedule(db)
    start(db, job_id)
    return job_id


def test_it_grows_back_at_its_next_checkpoint_when_room_and_nobody_waits(db: Database) -> None:
    job_id = running_on_two_of_three(db)
    one_slot_workers(db, "c")
    schedule(db)
    wants = job(db, job_id)
    assert wants.resize_wanted_at is not None and wants.preempting_since is None  # no checkpoint yet
    checkpoint(db, job_id)
    schedule(db)
    growing = job(db, job_id)
    assert growing.preempting_since is not None and growing.resize_reason == "grow"
    stop_nodes(db, job_id)
    schedule(db)
    assert hosts_of(db, job_id) == ["a", "b", "c"]
    assert events(db, job_id, "resize") == [{"from": 2, "to": 3, "reason": "grow"}]
    assert attempt_reasons(db, job_id)[0] == "resized"


def test_it_grows_only_onto_hosts_of_its_own_network_kind(db: Database) -> None:
    """Its nodes in networks of their own meet only such peers (placement.one_network_kind)."""
    job_id = running_on_two_of_three(db)
    with db.transaction() as s:
        make_worker(s, "plain", gpus=1, meshes=False, multinode_open_to_all=True)
    schedule(db)
    assert job(db, job_id).resize_wanted_at is None  # no room of its kind
    one_slot_workers(db, "c")
    schedule(db)
    assert job(db, job_id).resize_wanted_at is not None


def test_no_growth_while_an_equal_priority_job_waits_or_within_the_interval(db: Database) -> None:
    one_slot_workers(db, "a", "b")
    job_id = submit_elastic(db, 2, 3)
    schedule(db)
    start(db, job_id)
    with db.transaction() as s:
        s.get(Job, job_id).last_resize_at = utcnow()  # type: ignore[union-attr]
    one_slot_workers(db, "c")
    schedule(db)  # the default interval (300 s) since its last resize has not passed
    assert job(db, job_id).resize_wanted_at is None
    db.settings.resize_interval_s = 0
    with db.transaction() as s:
        other = make_user(s, "other").id
    submit(db, other, nodes=2, priority=0)  # needs 2 nodes: waits, and outranks the growth
    schedule(db)
    assert job(db, job_id).resize_wanted_at is None


def test_a_preemption_and_a_lost_node_at_once_leave_one_consistent_state(db: Database) -> None:
    """The pass reaps first: the lost node's resize stops the job, and the preemptor, finding it
    stopping already, preempts nothing more and waits for its GPUs; then each is placed once."""
    one_slot_workers(db, "a", "b", "c")
    job_id = submit_elastic(db, 1, 3, max_retries=0)
    schedule(db)
    start(db, job_id)
    with db.transaction() as s:
        other = make_user(s, "urgent").id
    high = submit(db, other, priority=5)
    worker_gone(db, "c")
    schedule(db)
    stopping = job(db, job_id)
    assert stopping.resize_reason == "node lost" and events(db, job_id, "preempted") == []
    assert job(db, high).state == JobState.QUEUED
    end_live_nodes(db, job_id)
    schedule(db)
    assert job(db, high).state == JobState.SCHEDULED
    assert job(db, job_id).state == JobState.SCHEDULED and job(db, job_id).nodes == 1
    assert events(db, job_id, "resize") == [{"from": 3, "to": 1, "reason": "node lost"}]
    with db.read() as s:
        taken = [(a.worker_name, a.gpu_index) for a in s.query(GpuAllocation).all()]
    assert sorted(taken) == [("a", 0), ("b", 0)]  # one GPU each, none twice, none on the lost host
