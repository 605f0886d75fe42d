"""Contract §13 on both databases, through the report writer a node calls: any number a rank
reports is a series (`?names=`, odd names and values kept out, never an error); a sweep's
`best` and `order=objective` follow its children's last values; ASHA records each child's
value once per rung, stops the ones outside the best 1/η (the supervisor's control sees it),
and a second review decides nothing twice."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from service.config import Settings
from service.db import Database
from service.jobs import metrics
from service.jobs.asha import Asha, keeps_going, review_sweeps
from service.jobs.reports import write_batch
from service.jobs.service import ListQuery, list_job_ids
from service.jobs.states import append_event, transition_job
from service.migrate import upgrade
from service.models import Job, JobEvent, MetricPoint, SweepRung
from service.nodes.values import Batch, NodeKey
from service.states import SWEEP, JobState
from tests.factories import make_job, make_user


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    else:
        url = request.getfixturevalue("pg_url")
    settings = Settings(home=tmp_path, database_url=url)
    upgrade(settings)
    database = Database(settings)
    yield database
    database.dispose()


def key(job_id: int) -> NodeKey:
    return NodeKey(job_id=job_id, attempt=1, node_rank=0)


def series(db: Database, job_id: int, names: str | None = None) -> dict[str, Any]:
    with db.read() as s:
        return json.loads(metrics.series_json(s, job_id, metrics.parse_names(names)))


# -- series ---------------------------------------------------------------------------------------


def test_any_numeric_name_is_a_series_and_nothing_else_is(db: Database) -> None:
    with db.transaction() as s:
        job_id = make_job(s, make_user(s).id, "running").id
    odd = {
        "bleu": 31.5,
        "flag": True,  # a boolean is no number
        "text": "x",
        "nan": float("nan"),  # the cleaner makes it null: no point
        "huge": 10**400,  # no float holds it
        "bad\x00name": 1.0,
        "\ud800": 3.0,  # a lone surrogate
    }
    batch = Batch(
        events=[
            {"type": "progress", "step": 1, "epoch": 0, "loss": 2.0, "ts": 1.0},
            {"type": "progress", "step": 2, "epoch": 0.0, **odd},
            {"type": "progress", "step": 2**40, "epoch": 1, "val_loss": 1.5, "val_accuracy": 0.5},
            {"type": "progress", "step": 3},  # no number: no point
        ]
    )
    assert write_batch(db, key(job_id), batch) is not None

    everything = series(db, job_id)
    assert everything["names"] == ["bleu", "loss", "val_accuracy", "val_loss"]
    points = everything["series"]
    assert [(p["step"], p["epoch"]) for p in points] == [(1, 0), (2, 0), (None, 1)]
    assert points[0]["loss"] == 2.0 and "reported_at" not in points[0]
    assert set(points[1]) == {"step", "epoch", "ts", "bleu"}
    assert points[2]["val_loss"] == 1.5 and points[2]["val_accuracy"] == 0.5
    assert all(p["ts"] for p in points)

    named = series(db, job_id, "val_loss,nope, loss")
    assert named["names"] == everything["names"]  # every name, whatever was asked
    assert [{k: v for k, v in p.items() if k != "ts"} for p in named["series"]] == [
        {"step": 1, "epoch": 0, "loss": 2.0},
        {"step": None, "epoch": 1, "val_loss": 1.5},
    ]
    assert series(db, job_id, "nope")["series"] == []
    assert series(db, job_id, " , ")["series"] == everything["series"]  # blank: every one


def test_names_with_quotes_and_paths_are_only_names(db: Database) -> None:
    with db.transaction() as s:
        job_id = make_job(s, make_user(s).id, "running").id
    odd = {'a"b': 1.0, "c\\d": 2.0, "$.e[0]": 3.0, "f'g": 4.0, "ünï": 5.0}
    write_batch(db, key(job_id), Batch(events=[{"step": 1, **odd}]))
    for name, value in odd.items():
        got = series(db, job_id, name)["series"]
        assert [p[name] for p in got] == [value], name


def test_a_named_read_writes_each_point_as_the_whole_read_does(db: Database) -> None:
    """`?names=` is built by PostgreSQL itself (its `ts` formatted in SQL): the same point
    reads the same with and without names, a timestamp with no fraction of a second too,
    and odd values (tiny, huge, negative) keep their value."""
    with db.transaction() as s:
        job_id = make_job(s, make_user(s).id, "running").id
    values = [1e-05, -2.5e300, 0.1 + 0.2, 7.0]
    write_batch(db, key(job_id), Batch(events=[{"step": i, "v": v, "w": 1.0} for i, v in enumerate(values)]))
    write_batch(db, key(job_id), Batch(events=[{"step": 9, "v": 3.0}]))
    with db.transaction() as s:  # the second batch's points at a whole second
        whole_second = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
        s.execute(update(MetricPoint).where(MetricPoint.step == 9).values(ts=whole_second))
    whole = series(db, job_id)["series"]
    named = series(db, job_id, "v")["series"]
    assert [p["ts"] for p in named] == [p["ts"] for p in whole]
    assert named[-1]["ts"] == "2026-01-02T03:04:05+00:00"
    # the same number, in the form the database keeps it (jsonb writes 1e300 in full digits)
    assert [float(p["v"]) for p in named] == [float(p["v"]) for p in whole] == [*values, 3.0]
    assert [p["w"] for p in series(db, job_id, "w")["series"]] == [1.0] * len(values)


def test_names_are_kept_once_across_batches(db: Database) -> None:
    with db.transaction() as s:
        job_id = make_job(s, make_user(s).id, "running").id
    for step in range(1, 4):
        write_batch(db, key(job_id), Batch(events=[{"step": step, "loss": 1.0 / step, f"m{step % 2}": 1}]))
    got = series(db, job_id)
    assert got["names"] == ["loss", "m0", "m1"]
    assert [p["step"] for p in got["series"]] == [1, 2, 3]


def test_a_job_from_before_the_series_is_read_from_its_progress_events(db: Database) -> None:
    with db.transaction() as s:
        job_id = make_job(s, make_user(s).id, "running").id
        append_event(s, job_id, "progress", {"step": 5, "epoch": 0, "loss": 1.5, "fraction": 0.5})
        append_event(s, job_id, "progress", {"step": 9, "epoch": 1, "val_loss": 1.25, "note": "x"})
    got = series(db, job_id)
    assert got["names"] == ["loss", "val_loss"]
    assert [{k: v for k, v in p.items() if k != "ts"} for p in got["series"]] == [
        {"step": 5, "epoch": 0, "loss": 1.5},
        {"step": 9, "epoch": 1, "val_loss": 1.25},
    ]
    assert [p["step"] for p in series(db, job_id, "val_loss")["series"]] == [9]


# -- ASHA, pure -----------------------------------------------------------------------------------


def test_rungs_and_verdicts() -> None:
    asha = Asha(min_epochs=1, reduction_factor=3)
    assert asha.rungs_below(10, epochs=12) == [(0, 1), (1, 3), (2, 9)]
    assert asha.rungs_below(10, epochs=9) == [(0, 1), (1, 3)]  # not at the last epoch
    assert asha.rungs_below(0, epochs=None) == []
    # fewer than η values: it goes on, however bad
    assert keeps_going(9.0, [1.0, 9.0], "min", 3)
    # n=3: only the best goes on
    assert keeps_going(1.0, [2.0, 3.0, 1.0], "min", 3)
    assert not keeps_going(2.0, [1.0, 3.0, 2.0], "min", 3)
    assert keeps_going(3.0, [1.0, 2.0, 3.0], "max", 3)
    # n=6: the best two; a tie with the best is not beaten
    assert keeps_going(1.0, [1.0, 1.0, 3, 4, 5, 6], "min", 3)
    assert not keeps_going(3.0, [1.0, 2.0, 3.0, 4, 5, 6], "min", 3)


# -- a sweep, through the report writer -----------------------------------------------------------


def make_sweep(db: Database, n: int, mode: str = "min") -> tuple[int, list[int]]:
    objective = {"metric": "val_loss", "mode": mode}
    sweep = {
        "grid": {"hyperparameters.lr": list(range(n))},
        "max_parallel": None,
        "objective": objective,
        "early_stop": {"kind": "asha", "min_epochs": 1, "reduction_factor": 3},
    }
    with db.transaction() as s:
        owner = make_user(s).id
        parent = make_job(s, owner, "queued", kind=SWEEP, sweep=sweep, attempt_row=False)
        transition_job(s, parent, JobState.RUNNING, "a sweep")
        children = [
            make_job(
                s,
                owner,
                "running",
                parent_id=parent.id,
                sweep_point={"hyperparameters.lr": i},
                objective=objective,
                hyperparameters={"epochs": 10},
            ).id
            for i in range(n)
        ]
        return parent.id, children


def epoch_end(epoch: int, val_loss: float) -> Batch:
    return Batch(events=[{"type": "progress", "epoch": epoch, "step": epoch * 10, "val_loss": val_loss}])


def job_row(db: Database, job_id: int) -> Job:
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


def test_best_order_and_asha_stops_outside_the_best_third(db: Database) -> None:
    parent, (a, b, c, d) = make_sweep(db, 4)
    # rung 0 (epoch 1): a=0.5, b=0.9 go on (fewer than 3 values); c=0.7 is the worst of 3 but one
    # value (a's) is better... of [0.5, 0.9, 0.7] only the best goes on: c stops.
    for job, value in ((a, 0.5), (b, 0.9)):
        assert write_batch(db, key(job), epoch_end(1, value)).stop is None  # type: ignore[union-attr]
    control = write_batch(db, key(c), epoch_end(1, 0.7))
    assert control is not None and control.stop == "early_stop"  # its supervisor is told at once
    assert job_row(db, c).stop_intent == "early_stop"
    assert job_row(db, c).stopped_early == {"epoch": 1, "value": 0.7}
    # a later report of c's (its ranks still winding down) says stop to the supervisor
    later = write_batch(db, key(c), Batch(events=[{"step": 11, "loss": 0.1}]))
    assert later is not None and later.stop == "early_stop"
    # d is the best at rung 0 so far: it goes on
    write_batch(db, key(d), epoch_end(1, 0.1))
    assert job_row(db, d).stop_intent is None

    with db.read() as s:
        rungs = {(r.rung, r.child_id): (r.value, r.verdict) for r in s.execute(select(SweepRung)).scalars()}
        stops = s.execute(select(JobEvent).where(JobEvent.type == "early_stop")).scalars().all()
    assert rungs == {
        (0, a): (0.5, "continue"),
        (0, b): (0.9, "continue"),
        (0, c): (0.7, "stop"),
        (0, d): (0.1, "continue"),
    }
    assert [(e.job_id, e.data["rung"], e.data["compared"]) for e in stops] == [(c, 0, 3)]

    # the last value counts for best and order: b improves past everyone at epoch 2
    write_batch(db, key(b), epoch_end(2, 0.05))
    best = (job_row(db, parent).sweep or {})["best"]
    assert best == {"job_id": b, "point": {"hyperparameters.lr": 1}, "value": 0.05}
    with db.read_connection() as conn:
        ids, cursor = list_job_ids(conn, None, ListQuery(parent=parent, order="objective"))
        first, nxt = list_job_ids(conn, None, ListQuery(parent=parent, order="objective", limit=3))
        rest, end = list_job_ids(conn, None, ListQuery(parent=parent, order="objective", limit=3, cursor=nxt))
    assert ids == [b, d, a, c] and cursor is None
    assert first + rest == ids and end is None

    # b reaches rung 1 (epoch 3) alone: it goes on; a reviewing pass decides nothing again
    write_batch(db, key(b), epoch_end(3, 0.04))
    with db.transaction() as s:
        assert review_sweeps(s) == 0
    with db.read() as s:
        assert len(s.execute(select(SweepRung)).scalars().all()) == 5


def test_a_lost_review_is_made_up_by_the_scheduler_pass(db: Database) -> None:
    """The value reached the child's row but no rung was recorded (a crash between the two
    transactions): the pass records it and stops the child, once."""
    parent, (a, b, c) = make_sweep(db, 3, mode="max")
    for job, value in ((a, 0.9), (b, 0.8)):
        write_batch(db, key(job), epoch_end(1, value))
    with db.transaction() as s:  # c's report, stored, as if its review were lost
        metrics.record(s, c, 1, 1000, [{"epoch": 1, "val_loss": 0.1}])
    assert job_row(db, c).stop_intent is None
    with db.transaction() as s:
        assert review_sweeps(s) == 1
    assert job_row(db, c).stopped_early == {"epoch": 1, "value": 0.1}
    assert (job_row(db, parent).sweep or {})["best"]["job_id"] == a
    with db.transaction() as s:
        assert review_sweeps(s) == 0


def test_a_child_whose_stop_fails_ends_stopped_early_and_is_not_retried(db: Database) -> None:
    """Its nodes fail while they stop (a rank crashing on SIGTERM, a host lost): the stop was
    what was asked, so the child ends `succeeded` with `stopped_early`, and is not queued again
    only to be stopped at once."""
    from service.jobs.lifecycle import finish_node
    from service.nodes.values import NodeOutcome
    from service.states import NodeState
    from tests.factories import make_node_run

    parent, (a, b, c) = make_sweep(db, 3)
    with db.transaction() as s:
        child = s.get(Job, c)
        assert child is not None
        child.max_retries = 3
        make_node_run(s, child, "running", node_rank=0, worker_name="w")
    for job, value in ((a, 0.5), (b, 0.9), (c, 0.7)):
        write_batch(db, key(job), epoch_end(1, value))
    assert job_row(db, c).stop_intent == "early_stop"
    with db.transaction() as s:
        outcome = NodeOutcome(state=NodeState.FAILED, exit_code=-9, error="killed", retryable=True)
        finish_node(s, c, 1, 0, outcome)
    stopped = job_row(db, c)
    assert (stopped.state, stopped.attempt, stopped.error) == (JobState.SUCCEEDED, 1, None)
    assert stopped.stopped_early == {"epoch": 1, "value": 0.7}
