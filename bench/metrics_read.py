"""Reading a job's metrics on PostgreSQL against a bare FastAPI endpoint answering the same JSON.

    .venv/bin/python -m bench.metrics_read           # 100,000 points of 20 names, 20 requests each
    .venv/bin/python -m bench.metrics_read --smoke   # 2,000 points, 3 requests each

What runs: `torchjobs db upgrade` + `torchjobs server` on a fresh PostgreSQL database with the
product's default settings and no worker, and `bench/bare_app.py` served by uvicorn the same
way. One finished job (made through the product's gates, tests/factories.py) gets its points
the way a worker's reports store them: `service.jobs.reports.write_batch` of progress events
(1,000 a batch, each with `step`, `epoch` and 20 numeric names, full-precision floats), straight
against the stack's database. Then, from one kept-alive httpx client, each request timed on
its own (until its whole body is read):

* `GET /v1/jobs/{id}/metrics` (every name: the stored points spliced, never parsed) against
  the bare `GET /v1/series/all`, which answers the same bytes;
* `GET /v1/jobs/{id}/metrics?names=` of 2 of the 20 names (picked out by the database)
  against the bare `GET /v1/series/two`, the same bytes again.

The service's answers are saved to files before the bare app starts, which serves them from
memory as `application/json` from a `def` (the service's route is a `def` too); the bare
answers are checked byte for byte. Service and floor alternate, the one going first swapping
every round; the ratios are per pair. The client, the server and PostgreSQL share the
machine's cores.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import api as bench_api
from bench.common import (
    REPO,
    figure,
    paired_interval,
    print_figures,
    production_stack,
    workdir,
    write_result,
)
from service.testing import harness

NAMES = 20
BATCH = 1000
PICKED = ("loss", "val_loss")  # the 2 names of the `?names=` case


def series_names(n: int) -> list[str]:
    """`loss`, `val_loss`, then names a training loop reports (lr, grad norms, per-layer ...)."""
    return [*PICKED, *(f"metric_{i:02d}" for i in range(n - len(PICKED)))]


def write_points(pg_url: str, home: Path, broker_url: str, points: int) -> tuple[int, float]:
    """A succeeded job of the admin user with `points` progress reports of NAMES names each,
    written by the reports' own writer; (job id, seconds the writes took)."""
    from sqlalchemy import text

    from service.config import Settings
    from service.db import Database
    from service.jobs.reports import write_batch
    from service.nodes.values import Batch, NodeKey
    from tests.factories import make_job

    db = Database(Settings(home=home, database_url=pg_url, broker_url=broker_url))
    try:
        with db.transaction() as s:
            owner: int = s.execute(text("SELECT id FROM users WHERE name = 'admin'")).scalar_one()
            job_id = make_job(s, owner, "succeeded", name="bench-metrics").id
        key = NodeKey(job_id=job_id, attempt=1, node_rank=0)
        names = series_names(NAMES)
        rng = random.Random(0)
        steps_per_epoch = 1000
        started = time.monotonic()
        for first in range(0, points, BATCH):
            events = [
                {
                    "type": "progress",
                    "step": step,
                    "epoch": step // steps_per_epoch,
                    **{name: rng.random() for name in names},
                }
                for step in range(first + 1, min(points, first + BATCH) + 1)
            ]
            write_batch(db, key, Batch(events=events))
        seconds = time.monotonic() - started
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in ("metric_points", "metric_names", "job_events"):
                conn.execute(text(f"ANALYZE {table}"))
    finally:
        db.dispose()
    return job_id, seconds


def start_bare(scratch: Path, series: list[Path]) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m bench.bare_app PORT PAGE_JSON SERIES_JSON...` (an empty page: not used here)."""
    (scratch / "page.json").write_text("{}")
    return bench_api.start_bare(scratch, scratch / "page.json", *series)


def timed_get(client: httpx.Client, url: str) -> tuple[float, int]:
    """Milliseconds to the whole body, and its size."""
    t0 = time.perf_counter()
    resp = client.get(url)
    body = resp.content
    ms = (time.perf_counter() - t0) * 1000
    if resp.status_code != 200:
        raise RuntimeError(f"GET {url}: {resp.status_code} {resp.text[:300]}")
    return ms, len(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--points", type=int, default=100_000, help="progress reports of the job")
    parser.add_argument("--requests", type=int, default=20, help="timed requests of each endpoint")
    parser.add_argument("--artifacts", type=Path, default=REPO / "test-artifacts" / "bench" / "metrics-read")
    args = parser.parse_args(argv)
    if args.smoke:
        args.points, args.requests = 2_000, 3
    token = harness.ADMIN_TOKEN
    names = series_names(NAMES)

    with (
        workdir("tj-bench-metrics-", keep_on_error=args.artifacts) as scratch,
        production_stack(scratch / "postgres", {}) as (stack, pg_url),
    ):
        job_id, write_s = write_points(
            pg_url, scratch / "writer", stack.env["TORCHJOBS_BROKER_URL"], args.points
        )
        print(f"wrote {args.points:,} points to job {job_id} in {write_s:.1f} s", file=sys.stderr, flush=True)
        svc = f"{stack.url}/v1/jobs/{job_id}/metrics"
        cases = {"all": svc, "two": f"{svc}?names={','.join(PICKED)}"}
        bodies: dict[str, bytes] = {}
        with httpx.Client(headers=harness.auth(token), timeout=300) as client:
            for case, url in cases.items():
                resp = client.get(url)
                resp.raise_for_status()
                bodies[case] = resp.content
                (scratch / f"{case}.json").write_bytes(resp.content)
        everything = json.loads(bodies["all"])
        picked = json.loads(bodies["two"])
        if everything["names"] != sorted(names) or len(everything["series"]) != args.points:
            raise RuntimeError(
                f"the job answers {len(everything['names'])} names, {len(everything['series'])} points"
            )
        if len(picked["series"]) != args.points or set(picked["series"][0]) != {
            "step",
            "epoch",
            "ts",
            *PICKED,
        }:
            raise RuntimeError(f"?names= answers {picked['series'][:1]}")
        del everything, picked
        bare, bare_url = start_bare(scratch, [scratch / f"{case}.json" for case in cases])
        try:
            floors = {case: f"{bare_url}/v1/series/{case}" for case in cases}
            times: dict[str, dict[str, list[float]]] = {c: {"service": [], "bare": []} for c in cases}
            sizes: dict[str, dict[str, int]] = {c: {} for c in cases}
            with httpx.Client(headers=harness.auth(token), timeout=300) as client:
                for case in cases:  # the same bytes; one warm-up request each, not counted
                    if client.get(floors[case]).content != bodies[case]:
                        raise RuntimeError(f"the bare {case} does not answer the service's bytes")
                    client.get(cases[case]).raise_for_status()
                for i in range(args.requests):
                    for case in cases:
                        sides = [("service", cases[case]), ("bare", floors[case])]
                        for side, url in sides[i % 2 :] + sides[: i % 2]:
                            ms, size = timed_get(client, url)
                            times[case][side].append(ms)
                            sizes[case][side] = size
                    print(
                        f"  round {i + 1}: "
                        + ", ".join(
                            f"{c} {t['service'][-1]:.0f} / {t['bare'][-1]:.0f} ms" for c, t in times.items()
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            bare.terminate()
            bare.wait(timeout=15)

    result = make_result(times, sizes, args, write_s)
    write_result(args.json, result)
    print_figures(result)
    return 0


def make_result(
    times: dict[str, dict[str, list[float]]],
    sizes: dict[str, dict[str, int]],
    args: argparse.Namespace,
    write_s: float,
) -> dict[str, Any]:
    setup = f"PostgreSQL, {args.points:,} points x {NAMES} names"
    labels = {
        "all": (f"GET /v1/jobs/{{id}}/metrics, all {NAMES} names", "bare FastAPI GET of the same bytes"),
        "two": (
            f"GET /v1/jobs/{{id}}/metrics?names= of 2 of {NAMES}",
            "bare FastAPI GET of the same bytes",
        ),
    }
    figs = []
    for case, (measure, floor_name) in labels.items():
        svc, bare = times[case]["service"], times[case]["bare"]
        figs.append(
            figure(
                f"{measure} latency",
                "ms",
                svc,
                bare,
                setup=setup,
                floor_name=floor_name,
                note=f"body {sizes[case]['service'] / 1e6:.2f} MB (bare {sizes[case]['bare'] / 1e6:.2f} MB)",
            )
        )
    lines = [
        "| request | body bytes | torchjobs ms | bare ms | torchjobs MB/s | per-pair ratios |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for case, (measure, _) in labels.items():
        svc, bare = times[case]["service"], times[case]["bare"]
        med = statistics.median(svc)
        lines.append(
            f"| {measure} | {sizes[case]['service']:,} | {med:.1f} | {statistics.median(bare):.1f} | "
            f"{sizes[case]['service'] / 1e6 / (med / 1000):.0f} | {paired_interval(svc, bare) or '–'} |"
        )
    notes = [
        f"one kept-alive httpx client, {args.requests} timed requests of each endpoint (median, min–max), "
        "each timed until its whole body is read; service and bare alternate, the first swapping each round",
        f"{args.points:,} progress reports written by service.jobs.reports.write_batch, {BATCH:,} a batch, "
        f"in {write_s:.1f} s; `?names={','.join(PICKED)}`",
    ]
    if sizes["all"]["service"] != sizes["all"]["bare"] or sizes["two"]["service"] != sizes["two"]["bare"]:
        notes.append(f"FAILED: the bodies' sizes differ: {sizes}")
    return {
        "name": "metrics",
        "title": "Reading a job's metrics on PostgreSQL against a bare FastAPI endpoint of the same JSON",
        "figures": figs,
        "details": "Medians:\n\n" + "\n".join(lines),
        "notes": notes,
        "raw": {"times": times, "sizes": sizes},
    }


if __name__ == "__main__":
    raise SystemExit(main())
