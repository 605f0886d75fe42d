"""Benchmark for issue 4: event lag to SSE clients, and what ingestion costs the database.

    python bench/event_stream.py            # full: 1, 50 and 200 streams; both setups
    python bench/event_stream.py --smoke    # a quick run: 1 and 10 streams, shorter jobs

It starts real stacks with service/testing/harness.py (PostgreSQL + Redis; and with the full run also the
embedded SQLite setup), runs tests/scripts/progress.py under torchrun and measures:

* event lag: from the rank's write of a progress report (`t_write`, its wall clock, inside the
  report) to the moment each SSE client has parsed that event, over N concurrent streams on
  one job. All clients run in this one process (asyncio + httpx) on the same machine as the
  stack, so their own parsing is part of the figure.
* database writes of ingestion, PostgreSQL only: a job reporting 100 times a second, with no
  stream open, read from pg_stat_database (transactions committed, rows inserted and updated),
  less the same counters over an idle window of the same length (heartbeats, scheduler).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.testing import harness
from service.testing.harness import auth, script_job

STATS_FLUSH_S = 11.0  # PostgreSQL 15 backends publish their counters at least every 10 s


@dataclass
class LagRow:
    setup: str
    streams: int
    events: int
    complete: int
    p50: float
    p95: float
    worst: float
    p99: float
    stored_p50: float
    stored_p99: float


def _all_events(stack: harness.Stack, job_id: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with stack.client() as c:
        while True:
            page = c.get(f"/v1/jobs/{job_id}/events", params={"after": len(events)}).json()["items"]
            if not page:
                return events
            events.extend(page)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _lag(stack: harness.Stack, setup: str, streams: int, rate: float, seconds: float) -> LagRow:
    count = int(rate * seconds)
    job_id = stack.submit(script_job("progress.py", str(count), str(1 / rate), name=f"lag-{streams}"))["id"]
    path = f"/v1/jobs/{job_id}/events/stream"
    lags: list[float] = []
    stored: list[float] = []  # from the event's `ts`: when the API stored it

    async def one(client: httpx.AsyncClient) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        async with client.stream("GET", path, timeout=httpx.Timeout(10, read=300)) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    now = time.time()
                    event = json.loads(line[5:])
                    got.append(event)
                    if event["type"] == "progress" and "t_write" in event["data"]:
                        lags.append(now - event["data"]["t_write"])
                        stored.append(now - datetime.fromisoformat(event["ts"]).timestamp())
        return got

    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(base_url=stack.url, headers=auth(), limits=limits) as client:
        results = await asyncio.gather(*(one(client) for _ in range(streams)))
    truth = _all_events(stack, job_id)
    complete = sum(1 for r in results if r == truth)
    return LagRow(
        setup,
        streams,
        count,
        complete,
        _pct(lags, 0.5),
        _pct(lags, 0.95),
        max(lags, default=0),
        _pct(lags, 0.99),
        _pct(stored, 0.5),
        _pct(stored, 0.99),
    )


COUNTERS = ("commits", "events inserted", "log chunks inserted", "job rows updated", "all rows written")


def _pg_counters(pg_url: str) -> tuple[int, ...]:
    """Cumulative counters of the stack's database (PostgreSQL's statistics views)."""
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        database = conn.execute(
            "select xact_commit, tup_inserted, tup_updated from pg_stat_database"
            " where datname = current_database()"
        ).fetchone()
        assert database is not None  # the current database always has its row
        commits, inserted, updated = database
        tables: dict[str, int] = dict(
            conn.execute(
                "select relname, n_tup_ins + n_tup_upd from pg_stat_user_tables"
                " where relname in ('job_events', 'log_chunks')"
            ).fetchall()
        )
        jobs = conn.execute("select n_tup_upd from pg_stat_user_tables where relname = 'jobs'").fetchone()
        assert jobs is not None  # the schema's jobs table
        (jobs_updated,) = jobs
    return (
        int(commits),
        int(tables.get("job_events", 0)),
        int(tables.get("log_chunks", 0)),
        int(jobs_updated),
        int(inserted) + int(updated),
    )


def _batches(events: list[dict[str, Any]]) -> int:
    """Transactions that carried progress events: events of one batch are stamped within a few
    milliseconds of each other, and batches are about 0.5 s apart."""
    stamps = sorted(datetime.fromisoformat(e["ts"]).timestamp() for e in events if e["type"] == "progress")
    return sum(1 for a, b in zip([-1e18, *stamps], stamps, strict=False) if b - a > 0.1)


def _writes(stack: harness.Stack, pg_url: str, seconds: float, flush_s: float) -> dict[str, Any]:
    """What the database does per second for a job reporting 100 times a second, less the
    background (heartbeats, scheduler) measured over an idle window first."""
    time.sleep(flush_s)
    c0 = _pg_counters(pg_url)
    time.sleep(seconds + flush_s)
    c1 = _pg_counters(pg_url)
    idle_window = seconds + flush_s
    background = [(b - a) / idle_window for a, b in zip(c0, c1, strict=True)]

    job = stack.submit(script_job("progress.py", str(int(100 * seconds)), "0.01", name="writes"))
    stack.wait_job(job["id"], states=("running",))
    s0 = _pg_counters(pg_url)
    t0 = time.monotonic()
    time.sleep(seconds + 4.0 + flush_s)  # no polling of ours inside the window
    s1 = _pg_counters(pg_url)
    window = time.monotonic() - t0
    done = stack.wait_job(job["id"])
    net = [((b - a) - bg * window) / seconds for a, b, bg in zip(s0, s1, background, strict=True)]
    events = _all_events(stack, job["id"])
    return {
        "succeeded": done["state"] == "succeeded",
        "reports": sum(1 for e in events if e["type"] == "progress"),
        "seconds": seconds,
        "batches_s": _batches(events) / seconds,
        "net": dict(zip(COUNTERS, net, strict=True)),
        "background": dict(zip(COUNTERS, background, strict=True)),
    }


def _print_lag(rows: list[LagRow]) -> None:
    print("\nEvent lag: rank's write -> SSE client's receipt (seconds); 'stored': from the")
    print("event's `ts` (when the API's database stored it) to the receipt")
    head = f"{'setup':<22} {'streams':>7} {'events':>7} {'complete':>9} {'p50':>7} {'p95':>7} {'max':>7}"
    print(f"{head} {'p99':>7} {'stored50':>8} {'stored99':>8}")
    for r in rows:
        print(
            f"{r.setup:<22} {r.streams:>7} {r.events:>7} {r.complete:>5}/{r.streams:<3} "
            f"{r.p50:>7.3f} {r.p95:>7.3f} {r.worst:>7.3f} "
            f"{r.p99:>7.3f} {r.stored_p50:>8.3f} {r.stored_p99:>8.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="a quick run")
    args = parser.parse_args()
    counts = [1, 10] if args.smoke else [1, 50, 200]
    seconds = 2.0 if args.smoke else 5.0
    rate = 20.0
    rows: list[LagRow] = []

    import redis

    home = Path(tempfile.mkdtemp(prefix="tj-bench-"))
    (home / "prod").mkdir()
    (home / "emb").mkdir()
    pg_url = harness.create_pg_database()
    redis_url = f"{harness.REDIS_URL}/12"
    redis.Redis.from_url(redis_url).flushdb()
    try:
        prod = harness.production_stack(home / "prod", pg_url, redis_url)
    except BaseException:
        harness.drop_pg_database(pg_url)
        raise
    try:
        for n in counts:
            rows.append(asyncio.run(_lag(prod, "PostgreSQL + Redis", n, rate, seconds)))
        writes = _writes(prod, pg_url, 3.0 if args.smoke else 10.0, 2.0 if args.smoke else STATS_FLUSH_S)
    finally:
        prod.stop()
        harness.drop_pg_database(pg_url)

    if not args.smoke:
        emb = harness.embedded_stack(home / "emb")
        try:
            for n in counts:
                rows.append(asyncio.run(_lag(emb, "SQLite, polled 0.1 s", n, rate, seconds)))
        finally:
            emb.stop()

    _print_lag(rows)
    print(f"\n(each job: {rate:.0f} progress reports a second for {seconds:.0f} s; 'complete' = streams that")
    print(" received exactly the job's event list, in order)")
    print("\nIngestion cost on PostgreSQL: a job reporting 100 times a second, no stream open")
    ok = "succeeded" if writes["succeeded"] else "DID NOT SUCCEED"
    print(f"  reports stored: {writes['reports']} in {writes['seconds']:.0f} s (the job {ok})")
    print(f"  transactions carrying its reports (batches): {writes['batches_s']:.1f}/s")
    print(f"  {'per second, all processes':<28} {'with the job':>13} {'background':>11}")
    for name in COUNTERS:
        print(f"  {name:<28} {writes['net'][name]:>13.1f} {writes['background'][name]:>11.1f}")
    print("  ('with the job' is net of the background; smoke figures are rough)")
    if statistics.fmean(r.complete / r.streams for r in rows) < 1:
        sys.exit("some streams did not receive the full event list")


if __name__ == "__main__":
    main()
