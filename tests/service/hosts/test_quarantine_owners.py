"""Contract §8 (v3): what a job's own code can cause (its ranks' exits and signals, a stall,
what they print) only quarantines a host once jobs of two different owners failed so in a row
there; what the worker or the scheduler sees for itself (a lost node, a failed pre-flight of
ranks that run only torchjobs' code) counts alone. Driven through the real paths: the node's
end a worker reports (`record_end`) and the scheduler's reaper (`reap`), on both databases."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db import Database
from service.hosts.health import HostVerdict, readmit
from service.jobs.lifecycle import host_verdict, record_end
from service.migrate import upgrade
from service.models import Job, JobEvent, User, Worker
from service.nodes.values import NodeKey, NodeOutcome
from service.scheduler.reaper import reap
from service.states import NodeState
from tests.factories import BUILTIN, make_job, make_node_run, make_user, make_worker

SCRIPT = {"kind": "script", "path": "train.py", "args": []}
# what a worker reports for each kind of failure the job's own code can cause
SELF_KILLED = NodeOutcome(
    state=NodeState.FAILED,
    exit_code=-9,
    error="node 0 on worker w1, rank 0 (local rank 0) exited with code -9\nSignal 9 (SIGKILL) received",
    retryable=True,
)
STALLED = NodeOutcome(
    state=NodeState.FAILED,
    exit_code=-15,
    error="stalled: no rank reported anything for 60 s (stall_timeout_s) on node 0 (worker w1)",
    retryable=True,
)
NCCL_PRINTED = NodeOutcome(
    state=NodeState.FAILED,
    exit_code=1,
    error="node 0 on worker w1 exited with code 1\nRuntimeError: NCCL communicator was aborted",
    retryable=True,
)
PREFLIGHT = NodeOutcome(
    state=NodeState.FAILED,
    exit_code=1,
    error=(
        "node 0 on worker w1, rank 1 (local rank 1) exited with code 1\nworkers.runtime.preflight."
        "PreflightError: rank 1 of 2 (node 0, host w1): pre-flight could not connect to every other rank"
    ),
    retryable=True,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    url = (
        f"sqlite:///{tmp_path / 'db.sqlite'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    settings = Settings(home=tmp_path, database_url=url, quarantine_after=3)
    upgrade(settings)
    database = Database(settings)
    with database.transaction() as s:
        make_worker(s, "w1")
        make_user(s, "alice")
        make_user(s, "bob")
    yield database
    database.dispose()


def user_id(s: Session, name: str) -> int:
    return s.execute(select(User.id).where(User.name == name)).scalar_one()


def fail(db: Database, who: str, outcome: NodeOutcome, entrypoint: dict[str, Any] | None = None) -> int:
    """One job of `who`'s runs on w1 and its only node ends with `outcome`, as its worker reports."""
    with db.transaction() as s:
        job = make_job(s, user_id(s, who), "running", entrypoint=entrypoint or SCRIPT, max_retries=0)
        make_node_run(s, job, "running", worker_name="w1", worker_session="w1-session")
        job_id = job.id
    record_end(db, NodeKey(job_id=job_id, attempt=1, node_rank=0), outcome, worker="w1")
    return job_id


def host(db: Database) -> Worker:
    with db.transaction() as s:
        worker = s.get(Worker, "w1")
        assert worker is not None
        s.expunge(worker)
        return worker


def told(db: Database, job_id: int) -> list[dict[str, Any]]:
    with db.transaction() as s:
        rows = s.execute(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "quarantine"))
        return [e.data for e in rows.scalars()]


def test_whose_word_each_failure_is() -> None:
    """The ranks' exits, signals, stalls and output are the job's; a failed pre-flight is the
    host's only from ranks that run nothing but torchjobs' code (anyone else's could print it)."""
    builtin = Job(entrypoint=BUILTIN, code=None, environment=None)
    script = Job(entrypoint=SCRIPT, code=None, environment=None)
    with_code = Job(entrypoint=BUILTIN, code="ab" * 32, environment=None)
    with_pip = Job(entrypoint=BUILTIN, code=None, environment={"pip": ["evil==1"]})
    # GLOO_SOCKET_IFNAME=nosuch fails a builtin job's pre-flight by the user's own choice
    with_env = Job(entrypoint=BUILTIN, code=None, environment=None, env={"GLOO_SOCKET_IFNAME": "nosuch"})
    for outcome in (SELF_KILLED, STALLED, NCCL_PRINTED):
        assert host_verdict(outcome, builtin) is HostVerdict.JOB_FAILED_HERE
    assert host_verdict(PREFLIGHT, builtin) is HostVerdict.FAILED_HERE
    for job in (script, with_code, with_pip, with_env, None):
        assert host_verdict(PREFLIGHT, job) is HostVerdict.JOB_FAILED_HERE


def test_one_owners_self_killing_jobs_do_not_quarantine_a_host(db: Database) -> None:
    """Four of alice's jobs in a row SIGKILL, stall or print an NCCL error: the host stays in."""
    for outcome in (SELF_KILLED, STALLED, NCCL_PRINTED, SELF_KILLED):
        fail(db, "alice", outcome)
    fail(db, "alice", SELF_KILLED, entrypoint=BUILTIN)  # a builtin job's signal is still its own
    fail(db, "alice", PREFLIGHT)  # printed by a script: its word, not the worker's
    w = host(db)
    assert (w.infra_failures, w.job_failures, w.quarantine_reason) == (6, 6, None)


def test_job_caused_failures_of_two_owners_in_a_row_quarantine_it(db: Database) -> None:
    for _ in range(3):
        assert not told(db, fail(db, "alice", SELF_KILLED))
    assert host(db).quarantine_reason is None
    last = fail(db, "bob", STALLED)
    sick = host(db)
    assert sick.quarantine_reason is not None and sick.infra_failures == 4
    assert sick.quarantine_reason.startswith("4 attempts in a row ended in an infrastructure failure")
    assert "4 of them of a kind a job can cause, by jobs of two or more owners" in sick.quarantine_reason
    assert [e["worker"] for e in told(db, last)] == ["w1"]


def test_readmit_forgets_the_owners_too(db: Database) -> None:
    fail(db, "alice", SELF_KILLED)
    fail(db, "bob", SELF_KILLED)
    fail(db, "alice", SELF_KILLED)
    assert host(db).quarantine_reason is not None
    with db.transaction() as s:
        readmit(s, "w1")
    w = host(db)
    assert (w.infra_failures, w.job_failures, w.job_failure_owners, w.quarantine_reason) == (0, 0, None, None)


def test_a_success_starts_the_row_and_its_owners_again(db: Database) -> None:
    fail(db, "bob", SELF_KILLED)
    fail(db, "alice", SELF_KILLED)  # two owners: one more failure and the host would be out
    with db.transaction() as s:
        job = make_job(s, user_id(s, "bob"), "running", entrypoint=SCRIPT)
        make_node_run(s, job, "running", worker_name="w1", worker_session="w1-session")
        job_id = job.id
    done = NodeOutcome(state=NodeState.SUCCEEDED, exit_code=0)
    record_end(db, NodeKey(job_id=job_id, attempt=1, node_rank=0), done, worker="w1")
    w = host(db)
    assert (w.infra_failures, w.job_failures, w.job_failure_owners) == (0, 0, None)
    for _ in range(3):  # bob's failure was before the success: alice is alone in this row
        fail(db, "alice", SELF_KILLED)
    assert host(db).quarantine_reason is None


def test_a_peers_echo_counts_nothing(db: Database) -> None:
    """Of a two-node job only the node that failed first counts against its host."""
    with db.transaction() as s:
        job = make_job(s, user_id(s, "alice"), "running", entrypoint=SCRIPT, nodes=2, mode="ddp")
        for rank in (0, 1):
            make_node_run(s, job, "running", node_rank=rank, worker_name="w1", worker_session="w1-session")
        job_id = job.id
    for rank, outcome in ((0, SELF_KILLED), (1, NCCL_PRINTED)):
        record_end(db, NodeKey(job_id=job_id, attempt=1, node_rank=rank), outcome, worker="w1")
    assert (host(db).infra_failures, host(db).job_failures) == (1, 1)


def test_one_owners_lost_nodes_quarantine_a_host_alone(db: Database) -> None:
    """The scheduler's word: alice's nodes lost when w1 restarts count without a second owner,
    while her two self-killed jobs before them still do not."""
    fail(db, "alice", SELF_KILLED)
    fail(db, "alice", SELF_KILLED)
    with db.transaction() as s:
        for _ in range(3):
            job = make_job(s, user_id(s, "alice"), "running", entrypoint=SCRIPT, max_retries=1)
            make_node_run(s, job, "running", worker_name="w1", worker_session="w1-session")
        worker = s.get(Worker, "w1")
        assert worker is not None
        worker.session = "a newer process"  # the worker restarted: its nodes are gone
    with db.transaction() as s:
        reap(s, db.settings)
    sick = host(db)
    assert sick.quarantine_reason is not None, "three lost nodes in a row"
    assert sick.quarantine_reason.startswith("5 attempts in a row ended in an infrastructure failure")
    assert "2 of them of a kind a job can cause, by one owner's jobs: not counted" in (sick.quarantine_reason)


def test_one_owners_failed_pre_flights_quarantine_a_host_alone(db: Database) -> None:
    """A builtin job's ranks run only torchjobs' code: their failed pre-flight is the host's."""
    for _ in range(3):
        fail(db, "alice", SELF_KILLED)
    fail(db, "alice", PREFLIGHT, entrypoint=BUILTIN)
    fail(db, "alice", PREFLIGHT, entrypoint=BUILTIN)
    assert host(db).quarantine_reason is None
    last = fail(db, "alice", PREFLIGHT, entrypoint=BUILTIN)
    sick = host(db)
    assert sick.quarantine_reason is not None and sick.infra_failures == 6
    assert "pre-flight could not connect" in sick.quarantine_reason
    assert [e["worker"] for e in told(db, last)] == ["w1"]
