"""What a scheduling pass reads of the queue, on both databases: the one hyperparameter that
decides CUDA-only placement (`amp: fp16`) read as a field of the JSON, and the dependencies of
the queued jobs read by a join (not an IN list of every queued id), kept to the rows the pass
holds."""

from __future__ import annotations

from service.db import Database
from service.jobs.dependencies import readiness
from service.models import JobDependency
from service.scheduler.placement_pass import place, placement_inputs
from tests.factories import make_job, make_user, make_worker


def test_only_fp16_autocast_needs_cuda_and_waits_for_it(db: Database) -> None:
    hyper = [{"amp": "fp16"}, {"amp": "bf16"}, {"amp": True}, {}, None, {"lr": 0.1, "amp": "fp16"}]
    with db.transaction() as s:
        owner = make_user(s, "u").id
        make_worker(s, "cpu-host", gpus=8)
        ids = [make_job(s, owner, hyperparameters=h).id for h in hyper]
    with db.transaction() as s:
        queued = {q.id: q.needs_cuda for q in placement_inputs(s).queued}
    assert queued == dict(zip(ids, [True, False, False, False, False, True], strict=True))
    with db.transaction() as s:
        placed = {d.job_id for d in place(s, db.settings)}
    assert placed == {ids[1], ids[2], ids[3], ids[4]}  # the fp16 ones wait for a CUDA worker


def test_dependencies_are_those_of_the_asked_queued_jobs(db: Database) -> None:
    with db.transaction() as s:
        owner = make_user(s, "u").id
        done = make_job(s, owner, "succeeded").id
        failed = make_job(s, owner, "failed").id
        running = make_job(s, owner, "running").id
        a, b, c, d = (make_job(s, owner).id for _ in range(4))
        ended = make_job(s, owner, "succeeded").id  # not queued: its dependency is not the pass's
        for job, on, condition in (
            (a, done, "succeeded"),
            (b, failed, "succeeded"),
            (c, running, "ended"),
            (d, running, "ended"),
            (ended, running, "succeeded"),
        ):
            s.add(JobDependency(job_id=job, depends_on_id=on, condition=condition))
    with db.transaction() as s:
        ready = readiness(s, [a, b, c])  # d is queued too, but not among those asked
    assert set(ready.doomed) == {b} and "can never hold" in ready.doomed[b]
    assert set(ready.waiting) == {c} and f"job {running} to end" in ready.waiting[c]
    with db.transaction() as s:
        assert readiness(s, []).waiting == {}
        assert set(readiness(s, [a, b, c, d, ended]).waiting) == {c, d}
