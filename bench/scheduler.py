"""Scheduler: placement decisions per second on PostgreSQL, and how soon a freed GPU is reused.

    .venv/bin/python -m bench.scheduler             # 1,000 jobs on 100 hosts; both setups, ~2 min
    .venv/bin/python -m bench.scheduler --smoke

1. Placement, in this process, on a fresh PostgreSQL database after `torchjobs db upgrade`:
   100 online workers with fresh heartbeats and 8 GPU slots each (800 slots), and 1,000 queued
   jobs of mixed sizes (half of them 1 GPU, then ddp on 2, 4 and 8 GPUs, and 2 nodes x 4 GPUs;
   a tenth at a higher priority), more than the slots hold. Measured:
   * `service.scheduler.placement_pass.place` inside a transaction that is rolled back afterwards, so each
     run decides the same 1,000 jobs from scratch (every job gets a placement or a pending
     reason: 1,000 decisions), including the flush of every row it writes;
   * the floor: the pure placement function `service.scheduler.placement.plan` on the same
     jobs and hosts, no database;
   * one committed `run_pass` (reap, place, commit, hand to a dispatcher that discards the
     messages), and then a second one with the leftover queue that no longer fits: what each
     pass costs while a queue waits.
2. Freed GPU to the next job's `scheduled`, on real stacks with one worker of one GPU slot: a
   chain of short script jobs (tests/scripts/hello.py) submitted at once, each waiting for the
   one before; the gap between the `state` event of a job's end (which frees its slot in the
   same transaction) and the next job's `scheduled` event. The product's default scheduler
   interval (1 s) applies: nothing wakes the scheduler when a job ends.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    all_events,
    bench_env,
    figure,
    parse_ts,
    print_figures,
    production_stack,
    workdir,
    write_result,
)
from service.testing import harness

# (share of the jobs, nodes, gpus_per_node, mode)
JOB_MIX = (
    (0.5, 1, 1, "single"),
    (0.2, 1, 2, "ddp"),
    (0.15, 1, 4, "ddp"),
    (0.1, 1, 8, "ddp"),
    (0.05, 2, 4, "ddp"),
)


def seed_database(db: Any, hosts: int, gpus: int, jobs: int, users: int = 1) -> None:
    """Hosts as their agents register, jobs as the API creates them: through the product's gates.

    With `users` > 1 the jobs go round the users, and every other user has a `gpu_quota` of
    16 (contract §9): fair share orders them, and quotas hold some back."""
    from service.hosts.states import upsert_worker
    from service.jobs.states import create_job
    from service.models import Job, User, utcnow

    now = utcnow()
    with db.transaction() as s:
        owners = [
            User(
                name=f"bench-{u}",
                token_hash=uuid.uuid4().hex,
                is_admin=users == 1,
                gpu_quota=16 if u % 2 else None,
            )
            for u in range(users)
        ]
        s.add_all(owners)
        s.flush()
        for i in range(hosts):
            upsert_worker(
                s,
                name=f"host-{i:03d}",
                address=f"10.0.{i // 250}.{i % 250 + 1}",
                accelerator="cpu",
                gpus=gpus,
                session_id=uuid.uuid4().hex,
                now=now,
            )
        kinds = [k for share, *k in JOB_MIX for _ in range(round(share * 100))]
        for i in range(jobs):
            nodes, per_node, mode = kinds[i % len(kinds)]
            job = Job(
                owner_id=owners[i % users].id,
                name=f"sched-{i}",
                mode=mode,
                nodes=nodes,
                gpus_per_node=per_node,
                entrypoint={"kind": "builtin", "model": "cnn", "dataset": "digits"},
                hyperparameters={"epochs": 1},
                priority=1 if i % 10 == 0 else 0,
                pending_reason="waiting for the scheduler",
            )
            create_job(s, job)
            job.queued_at = now - timedelta(seconds=jobs - i)  # submitted a second apart


def keep_fresh(db: Any) -> None:
    """Heartbeats, so that no pass reaps the simulated hosts however long the runs take."""
    from sqlalchemy import update

    from service.models import Worker, utcnow

    with db.transaction() as s:
        s.execute(update(Worker).values(last_heartbeat=utcnow()))


def place_rates(pg_url: str, scratch: Path, args: argparse.Namespace, users: int) -> tuple[list[float], int]:
    """place() on a fresh database, in a transaction rolled back each run: decisions per second."""
    from service.config import Settings
    from service.db import Database
    from service.scheduler.placement_pass import place

    env = bench_env(scratch, TORCHJOBS_DATABASE_URL=pg_url)
    subprocess.run(harness.torchjobs_cmd("db", "upgrade"), env=env, check=True, capture_output=True, cwd=REPO)
    settings = Settings(home=scratch, database_url=pg_url)
    db = Database(settings)
    rates, placed = [], 0
    try:
        seed_database(db, args.hosts, args.gpus, args.jobs, users=users)
        for _ in range(args.runs):
            keep_fresh(db)
            with db.sessionmaker() as s:
                s.begin()
                t0 = time.perf_counter()
                sent = place(s, settings)
                s.flush()
                rates.append(args.jobs / (time.perf_counter() - t0))
                s.rollback()
            placed = len({d.job_id for d in sent})
    finally:
        db.dispose()
    return rates, placed


def fair_share_bench(scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Contract §9's cost: the same queue and hosts, one owner (the figure before fair share)
    against 50 owners, half of them with a quota; both measured in this run."""
    rates: dict[int, list[float]] = {}
    placed: dict[int, int] = {}
    for users in (1, args.users):
        pg_url = harness.create_pg_database()
        try:
            rates[users], placed[users] = place_rates(pg_url, scratch / f"fair-{users}", args, users)
        finally:
            harness.drop_pg_database(pg_url)
    return figure(
        "placement decisions/s with fair share and quotas",
        "decisions/s",
        rates[args.users],
        rates[1],
        setup=f"PostgreSQL, {args.jobs:,} jobs / {args.hosts} hosts / {args.users} users",
        floor_name="place() with one owner, no quota",
        target=">= 0.8",
        note=(
            f"{placed[args.users]} placed (one owner: {placed[1]}); every other user has gpu_quota 16. "
            "A placement writes its rows (about 3 ms each here), so a queue whose fair order places "
            "more jobs decides more slowly for doing more, not for planning slower"
        ),
    )


def placement_bench(pg_url: str, scratch: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    from sqlalchemy import func, select

    from service.config import Settings
    from service.db import Database
    from service.models import GpuAllocation, Job
    from service.scheduler.placement import plan
    from service.scheduler.placement_pass import place, placement_inputs, run_pass
    from service.states import JobState

    env = bench_env(scratch, TORCHJOBS_DATABASE_URL=pg_url)
    subprocess.run(harness.torchjobs_cmd("db", "upgrade"), env=env, check=True, capture_output=True, cwd=REPO)
    settings = Settings(home=scratch, database_url=pg_url)
    db = Database(settings)
    try:
        seed_database(db, args.hosts, args.gpus, args.jobs)
        service_rates, floor_rates, placed = [], [], []
        for _ in range(args.runs):
            keep_fresh(db)
            # the floor: the pure function on the same inputs, read by the product's own query
            with db.read() as s:
                inputs = placement_inputs(s)
                queued, hosts = inputs.queued, inputs.hosts
            t0 = time.perf_counter()
            decision = plan(queued, hosts, settings.starvation_s)
            floor_s = time.perf_counter() - t0
            floor_rates.append(len(queued) / floor_s)
            # the service: place() in a transaction, flushed, rolled back
            with db.sessionmaker() as s:
                s.begin()
                t0 = time.perf_counter()
                sent = place(s, settings)
                s.flush()
                service_s = time.perf_counter() - t0
                s.rollback()
            service_rates.append(len(queued) / service_s)
            placed.append(len({d.job_id for d in sent}))
            assert len({d.job_id for d in sent}) == len(decision.placements), "place() and plan() disagree"
        keep_fresh(db)
        discarded: list[Any] = []
        t0 = time.perf_counter()
        run_pass(db, settings, discarded.extend)
        first_pass_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_pass(db, settings, discarded.extend)
        steady_pass_s = time.perf_counter() - t0
        with db.read() as s:
            slots = s.execute(select(func.count()).select_from(GpuAllocation)).scalar_one()
            still = s.execute(
                select(func.count()).select_from(Job).where(Job.state == JobState.QUEUED)
            ).scalar_one()
    finally:
        db.dispose()
    setup = f"PostgreSQL, {args.jobs:,} jobs / {args.hosts} hosts"
    figs = [
        figure(
            "placement decisions/s (place(), rolled back)",
            "decisions/s",
            service_rates,
            floor_rates,
            setup=setup,
            floor_name="plan() alone, in memory",
            note=f"{statistics.median(placed):.0f} jobs placed per pass, the rest get a pending reason",
        ),
        figure(
            "run_pass, first (places and commits)",
            "s",
            [first_pass_s],
            setup=setup,
            note=f"{len(discarded)} node messages to the (discarding) dispatcher",
        ),
        figure(
            "run_pass, steady (queue waiting, nothing fits)",
            "s",
            [steady_pass_s],
            setup=setup,
            note=f"{still} jobs still queued, {slots} of {args.hosts * args.gpus} slots held",
        ),
    ]
    details = (
        f"Placement: {args.hosts} hosts x {args.gpus} slots, {args.jobs} queued jobs "
        "(50% single 1 GPU, 20% ddp 2, 15% ddp 4, 10% ddp 8, 5% ddp 2 nodes x 4; 10% at priority 1); "
        f"{args.runs} runs of place() and plan(); after the committed pass {slots} slots are held "
        f"and {still} jobs still queued."
    )
    return figs, details


def freed_gpu_bench(stack: harness.Stack, chain: int) -> list[float]:
    """Seconds from a job's terminal `state` event to the next job's `scheduled` event."""
    spec = {"mode": "single", "gpus_per_node": 1, "entrypoint": {"kind": "script", "path": "hello.py"}}
    ids = [stack.submit({**spec, "name": f"chain-{i}"})["id"] for i in range(chain + 1)]
    for job_id in ids:
        job = stack.wait_job(job_id, timeout=300)
        if job["state"] != "succeeded":
            raise RuntimeError(f"job {job_id} {job['state']}: {job.get('error')}")
    gaps = []
    for before, after in zip(ids, ids[1:], strict=False):
        ended = [
            parse_ts(e["ts"])
            for e in all_events(stack, before)
            if e["type"] == "state" and e["data"]["state"] in harness.TERMINAL
        ]
        scheduled = [
            parse_ts(e["ts"])
            for e in all_events(stack, after)
            if e["type"] == "state" and e["data"]["state"] == "scheduled"
        ]
        gaps.append(scheduled[0] - ended[0])
    return gaps


def one_slot_embedded(home: Path) -> Any:
    """`torchjobs up` with one GPU slot."""
    import contextlib

    @contextlib.contextmanager
    def run() -> Any:
        home.mkdir(parents=True, exist_ok=True)
        stack = harness.Stack(home=home, env=bench_env(home), port=harness.free_port(), embedded=True)
        try:
            stack._spawn("up", ["up", "--port", str(stack.port), "--gpus", "1", "--accelerator", "cpu"])
            harness.wait_for(stack._healthy, 60, "the API server")
            stack.wait_worker_online("local")
            yield stack
        finally:
            stack.stop()

    return run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8, help="slots per simulated host")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--users", type=int, default=50, help="owners in the fair-share figure")
    parser.add_argument("--chain", type=int, default=6, help="freed-GPU gaps measured per setup")
    parser.add_argument(
        "--setups", nargs="+", default=["postgres", "embedded"], choices=["postgres", "embedded"]
    )
    parser.add_argument("--artifacts", type=Path, default=REPO / "test-artifacts" / "bench" / "scheduler")
    args = parser.parse_args(argv)
    if args.smoke:
        args.jobs, args.hosts, args.runs, args.chain, args.setups = 200, 20, 1, 1, ["postgres"]
        args.users = 10

    with workdir("tj-bench-sched-", keep_on_error=args.artifacts) as scratch:
        pg_url = harness.create_pg_database()
        try:
            figs, details = placement_bench(pg_url, scratch / "placement", args)
        finally:
            harness.drop_pg_database(pg_url)
        figs.append(fair_share_bench(scratch, args))
        print("placement done", file=sys.stderr, flush=True)
        for setup in args.setups:
            if setup == "postgres":
                with production_stack(scratch / "postgres", {"w1": 1}) as (stack, _):
                    gaps, label = freed_gpu_bench(stack, args.chain), "PostgreSQL + Redis"
                note = "woken by the Redis wake-up of the commit that freed the GPU"
            else:
                with one_slot_embedded(scratch / "embedded") as stack:
                    gaps, label = freed_gpu_bench(stack, args.chain), "embedded"
                note = "no Redis: the signal file under TORCHJOBS_HOME, watched every 50 ms"
            print(f"{label}: freed GPU -> next scheduled {[round(g, 3) for g in gaps]}", file=sys.stderr)
            figs.append(
                figure(
                    "freed GPU -> next job scheduled",
                    "s",
                    gaps,
                    setup=label,
                    note=note,
                )
            )

    result = {
        "name": "scheduler",
        "title": "Scheduler: placement rate on PostgreSQL, and a freed GPU's reuse",
        "figures": figs,
        "details": details,
        "notes": [],
    }
    write_result(args.json, result)
    print_figures(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
