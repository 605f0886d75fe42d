"""Sick hosts (contract §8) below the workers' processes: what each node end counts against
its host, the quarantine at the threshold, what the API shows, and the admin's readmit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.db import Database
from service.hosts.health import HostVerdict, record_node_end
from service.jobs.lifecycle import host_verdict
from service.migrate import upgrade
from service.models import Worker
from service.nodes.values import NodeOutcome
from service.scheduler.reaper import reap
from service.states import NodeState
from tests.factories import make_job, make_node_run, make_user, make_worker

TOKEN = "tj_quarantine_admin_token_0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    s = Settings(home=tmp_path, admin_token=TOKEN, quarantine_after=3)
    upgrade(s)
    return s


@pytest.fixture
def db(settings: Settings) -> Iterator[Database]:
    database = Database(settings)
    with database.transaction() as s:
        make_worker(s, "w1")
    yield database
    database.dispose()


def end(
    db: Database, verdict: HostVerdict, detail: str = "node 0 exited with code 1\nPreflightError: x"
) -> bool:
    with db.transaction() as s:
        return record_node_end(s, "w1", verdict, detail, quarantine_after=3)


def host(db: Database) -> Worker:
    with db.transaction() as s:
        worker = s.get(Worker, "w1")
        assert worker is not None
        s.expunge(worker)
        return worker


def test_what_each_end_says_of_its_host() -> None:
    # a failure the ranks tell is the job's word (contract §8 v3: test_quarantine_owners.py)
    assert host_verdict(NodeOutcome(state=NodeState.FAILED, retryable=True)) is HostVerdict.JOB_FAILED_HERE
    assert host_verdict(NodeOutcome(state=NodeState.FAILED, retryable=False)) is HostVerdict.WORKED
    assert host_verdict(NodeOutcome(state=NodeState.SUCCEEDED)) is HostVerdict.WORKED
    assert host_verdict(NodeOutcome(state=NodeState.CANCELLED)) is HostVerdict.NOTHING
    assert host_verdict(NodeOutcome(state=NodeState.LOST, retryable=True)) is HostVerdict.NOTHING


def test_failures_in_a_row_quarantine_the_host_and_a_working_end_resets_the_count(db: Database) -> None:
    assert not end(db, HostVerdict.FAILED_HERE) and not end(db, HostVerdict.FAILED_HERE)
    assert not end(db, HostVerdict.NOTHING)  # a cancel between them breaks no row
    end(db, HostVerdict.WORKED)
    assert host(db).infra_failures == 0
    assert not end(db, HostVerdict.FAILED_HERE) and not end(db, HostVerdict.FAILED_HERE)
    assert end(db, HostVerdict.FAILED_HERE), "the third in a row"
    sick = host(db)
    assert sick.infra_failures == 3 and sick.quarantine_reason is not None
    assert sick.quarantine_reason.startswith("3 attempts in a row ended in an infrastructure failure")
    assert "PreflightError: x" in sick.quarantine_reason
    assert not end(db, HostVerdict.FAILED_HERE)  # already quarantined: the reason stays the first
    end(db, HostVerdict.WORKED)  # a node still running there ends well: it stays quarantined
    assert host(db).quarantine_reason == sick.quarantine_reason


def test_the_api_shows_it_and_only_the_admin_readmits(settings: Settings, db: Database) -> None:
    for _ in range(3):
        end(db, HostVerdict.FAILED_HERE)
    with TestClient(create_app(settings, scheduler=False)) as api:
        alice = api.post("/v1/users", json={"name": "alice"}, headers=ADMIN).json()["token"]
        [w] = api.get("/v1/workers", headers=ADMIN).json()["items"]
        assert (w["state"], w["gpus_free"], w["infra_failures"]) == ("quarantined", 0, 3)
        assert w["reason"].startswith("3 attempts in a row")
        assert api.post("/v1/workers/nope/readmit", headers=ADMIN).status_code == 404
        assert api.post("/v1/workers/w1/readmit").status_code == 401
        assert (
            api.post("/v1/workers/w1/readmit", headers={"Authorization": f"Bearer {alice}"}).status_code
            == 403
        )
        assert api.get("/v1/workers", headers=ADMIN).json()["items"][0]["state"] == "quarantined"
        assert api.post("/v1/workers/w1%00/readmit", headers=ADMIN).status_code in (404, 422)
        back = api.post("/v1/workers/w1/readmit", headers=ADMIN)
        assert back.status_code == 200, back.text
        assert (back.json()["state"], back.json()["reason"], back.json()["gpus_free"]) == ("online", None, 2)
        assert api.post("/v1/workers/w1/readmit", headers=ADMIN).status_code == 200  # again: the same
    assert host(db).infra_failures == 0


def test_the_reaper_counts_a_lost_node_against_its_host_once(settings: Settings, db: Database) -> None:
    """A worker gone silent with a node of a live attempt: one failure there; a node of an
    attempt already over counts nothing."""
    with db.transaction() as s:
        owner = make_user(s).id
        live = make_job(s, owner, "running", entrypoint={"kind": "builtin"}, max_retries=1)
        make_node_run(s, live, "running", worker_name="w1", worker_session="w1-session")
        over = make_job(s, owner, "failed", entrypoint={"kind": "builtin"})
        make_node_run(s, over, "running", worker_name="w1", worker_session="w1-session")
        worker = s.get(Worker, "w1")
        assert worker is not None
        worker.session = "a newer process"  # the worker restarted: its old nodes are gone
    with db.transaction() as s:
        reap(s, settings)
    assert host(db).infra_failures == 1
    with db.transaction() as s:
        reap(s, settings)  # nothing left to lose: no second count
    assert host(db).infra_failures == 1
