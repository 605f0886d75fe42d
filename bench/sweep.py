"""Sweeps (contract §10): a 1,000-point sweep in one request, against 1,000 separate submits;
and the scheduler's pass with the sweep queued, against the same pass over 1,000 plain jobs.

    .venv/bin/python -m bench.sweep            # 1,000 points; ~2 min
    .venv/bin/python -m bench.sweep --smoke    # 100 points

On `torchjobs server` with PostgreSQL and Redis and no worker (nothing runs, nothing competes
for the CPU), over HTTP from one client:
1. the floor: N separate `POST /v1/jobs` of one builtin job, one after another, total time;
2. the service: one `POST /v1/jobs` whose `sweep.grid` has N points (`hyperparameters.lr` x
   `hyperparameters.seed`), time to its `201`; `--runs` sweeps.
Then, in this process, the product's `service.scheduler.placement_pass.place` on that database, in a
transaction rolled back afterwards, with `--hosts` simulated hosts of 8 free slots registered
inside that same transaction (so the server's own scheduler never sees them): once with the N
plain jobs queued (the floor), once with one sweep's N children queued instead (`max_parallel`
8: most children wait for their sweep, which the pass must work out for each).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import REPO, figure, print_figures, production_stack, workdir, write_result

ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "synthetic"}


def plain_spec(i: int) -> dict[str, Any]:
    return {"name": f"plain-{i}", "mode": "single", "entrypoint": ENTRY, "hyperparameters": {"lr": 0.001}}


def sweep_spec(points: int) -> dict[str, Any]:
    seeds = 10 if points >= 10 else 1
    lrs = [round(0.0001 * (i + 1), 6) for i in range(points // seeds)]
    return {
        "name": "sweep",
        "mode": "single",
        "entrypoint": ENTRY,
        "sweep": {
            "grid": {"hyperparameters.lr": lrs, "hyperparameters.seed": list(range(seeds))},
            "max_parallel": 8,
        },
    }


def pass_seconds(pg_url: str, home: Path, hosts: int, runs: int) -> list[float]:
    """place() over the queue as it stands, hosts registered and everything rolled back."""
    from service.config import Settings
    from service.db import Database
    from service.hosts.states import upsert_worker
    from service.models import utcnow
    from service.scheduler.placement_pass import place

    settings = Settings(home=home, database_url=pg_url)
    db = Database(settings)
    times = []
    try:
        for _ in range(runs):
            with db.sessionmaker() as s:
                s.begin()
                for i in range(hosts):
                    upsert_worker(
                        s,
                        name=f"sim-{i:03d}",
                        address=f"10.1.0.{i + 1}",
                        accelerator="cpu",
                        gpus=8,
                        session_id=uuid.uuid4().hex,
                        now=utcnow(),
                    )
                s.flush()
                t0 = time.perf_counter()
                place(s, settings)
                s.flush()
                times.append(time.perf_counter() - t0)
                s.rollback()
    finally:
        db.dispose()
    return times


def cancel_queued(pg_url: str, home: Path) -> None:
    """The plain jobs out of the queue, through the product's cancel (one transaction)."""
    from sqlalchemy import select

    from service.config import Settings
    from service.db import Database
    from service.jobs.service import cancel_job
    from service.models import Job, User
    from service.states import JobState

    db = Database(Settings(home=home, database_url=pg_url))
    try:
        with db.transaction() as s:
            admin = s.execute(select(User).where(User.is_admin)).scalars().first()
            assert admin is not None
            for job_id in s.execute(select(Job.id).where(Job.state == JobState.QUEUED)).scalars().all():
                cancel_job(s, admin, job_id)
    finally:
        db.dispose()


def measure(scratch: Path, args: argparse.Namespace) -> tuple[float, list[float], list[float], list[float]]:
    n = args.points
    with production_stack(scratch / "stack", {}) as (stack, pg_url), stack.client() as c:
        t0 = time.perf_counter()
        for i in range(n):
            assert c.post("/v1/jobs", json=plain_spec(i)).status_code == 201
        separate_s = time.perf_counter() - t0
        print(f"{n} separate POSTs: {separate_s:.2f} s", file=sys.stderr, flush=True)
        plain_pass = pass_seconds(pg_url, scratch, args.hosts, 3)
        cancel_queued(pg_url, scratch)
        sweep_s: list[float] = []
        sweep_pass: list[float] = []
        for run in range(args.runs):
            t0 = time.perf_counter()
            answer = c.post("/v1/jobs", json=sweep_spec(n))
            sweep_s.append(time.perf_counter() - t0)
            assert answer.status_code == 201, answer.text
            assert answer.json()["sweep"]["children"] == n
            if run == 0:
                sweep_pass = pass_seconds(pg_url, scratch, args.hosts, 3)
        print(f"one POST of {n} points: {[round(s, 2) for s in sweep_s]} s", file=sys.stderr)
    return separate_s, sweep_s, plain_pass, sweep_pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--points", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=20)
    parser.add_argument("--artifacts", type=Path, default=REPO / "test-artifacts" / "bench" / "sweep")
    args = parser.parse_args(argv)
    if args.smoke:
        args.points, args.runs, args.hosts = 100, 1, 5
    n = args.points

    with workdir("tj-bench-sweep-", keep_on_error=args.artifacts) as scratch:
        separate_s, sweep_s, plain_pass, sweep_pass = measure(scratch, args)
    setup = f"PostgreSQL + Redis, {n:,} jobs"
    figs = [
        figure(
            f"{n:,}-point sweep: POST -> 201",
            "s",
            sweep_s,
            [separate_s],
            setup=setup,
            floor_name=f"{n:,} separate POSTs, one after another",
            paired=False,
            note="one transaction: the parent, every child and their first events; checked once per context",
        ),
        figure(
            "scheduler pass (place()) with the sweep queued",
            "s",
            sweep_pass,
            plain_pass,
            setup=f"{setup}, {args.hosts} hosts x 8 slots",
            floor_name=f"the same pass over {n:,} plain queued jobs",
            note="max_parallel 8: 8 children placed, the rest wait for their sweep with a pending reason",
        ),
    ]
    result = {
        "name": "sweep",
        "title": "Sweeps: one request for many jobs, and the scheduler with them queued",
        "figures": figs,
        "details": (
            f"{n} points (hyperparameters.lr x hyperparameters.seed); {args.runs} sweeps; "
            f"place() run 3 times per queue, rolled back, with {args.hosts} simulated hosts."
        ),
        "notes": [],
    }
    write_result(args.json, result)
    print_figures(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
