"""API throughput and latency on PostgreSQL against a bare FastAPI endpoint, with wrk.

    bench/setup.sh                                  # installs wrk (idempotent)
    .venv/bin/python -m bench.api                   # 100,000 jobs, 3 x 10 s per endpoint, ~6 min
    .venv/bin/python -m bench.api --smoke           # 500 jobs, 1 x 1 s; Python load if no wrk

What runs: `torchjobs db upgrade` + `torchjobs server` on a fresh PostgreSQL database with the
product's default settings and no worker (submitted jobs just queue; the server's scheduler
runs, as in production), and `bench/bare_app.py` served by uvicorn the same way. wrk
(`-t2 -c32`, bench/wrk_report.lua for POST bodies and latency percentiles, the token with
`-H "Authorization: Bearer ..."`) loads one endpoint at a time; service and bare runs
alternate. Before the measurements 100,000 jobs (80% succeeded, 10% failed, 10% cancelled,
each with its attempt and node rows) are inserted straight into the tables with one SQL
statement each, owned by the admin user the server created, so every figure is on a
database of that size:

* `GET /v1/jobs/{id}` of a succeeded job, and of a running job whose progress another
  connection updates 5 times a second (each update invalidates its cached view), against the
  bare `GET /v1/things/{id}` (a `def`, like the other floors) and, for reference, the same as
  an `async def` (`GET /v1/async-things/{id}`: torchjobs' GET of one job is an `async def`);
* `POST /v1/jobs` (a valid builtin spec) against the bare `POST /v1/things` (pydantic body);
* `GET /v1/jobs` first page (50 jobs) against the bare `GET /v1/things`, which answers the
  same page's JSON (saved from the service before the bare app starts) from a `def`; and the
  first page against a page in the middle and at the oldest jobs, reached with `cursor`:
  keyset pagination should keep them flat.

wrk, the server and PostgreSQL share the machine's cores, so absolute figures are low on a
small machine; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.common import REPO, figure, print_figures, production_stack, workdir, write_result
from service.testing import harness

LUA = Path(__file__).with_name("wrk_report.lua")
CONNECTIONS = 32
PROGRESS_WRITES_PER_S = 5.0  # on the running job, while everything is measured
VISIBILITY_SAMPLES = 30
JOB_SPEC = {
    "name": "bench-api",
    "mode": "single",
    "gpus_per_node": 1,
    "entrypoint": {"kind": "builtin", "model": "cnn", "dataset": "digits"},
    "hyperparameters": {"epochs": 1},
}

INSERT_JOBS = """
INSERT INTO jobs (owner_id, name, state, mode, nodes, gpus_per_node, entrypoint, hyperparameters,
                  env, labels, max_retries, priority, attempt, progress, exit_code, last_event_seq,
                  created_at, queued_at, started_at, finished_at)
SELECT :owner, 'bulk-' || i,
       CASE WHEN i % 10 = 8 THEN 'failed' WHEN i % 10 = 9 THEN 'cancelled' ELSE 'succeeded' END,
       'ddp', 1, 2,
       '{"kind": "builtin", "model": "cnn", "dataset": "digits"}'::json,
       '{"epochs": 10, "batch_size": 64, "lr": 0.001}'::json,
       '{}'::json, '{"team": "bench"}'::json, 0, 0, 1,
       '{"epoch": 10, "epochs": 10, "step": 220, "total_steps": 220, "loss": 0.1}'::json,
       CASE WHEN i % 10 = 8 THEN 1 ELSE 0 END, 4,
       now() - make_interval(secs => :n - i), now() - make_interval(secs => :n - i),
       now() - make_interval(secs => :n - i), now() - make_interval(secs => :n - i)
FROM generate_series(1, :n) AS i
"""
INSERT_ATTEMPTS = """
INSERT INTO job_attempts (job_id, attempt, started_at, finished_at, exit_code, reason)
SELECT id, 1, started_at, finished_at, exit_code, state FROM jobs WHERE name LIKE 'bulk-%'
"""
INSERT_NODES = """
INSERT INTO node_runs (job_id, attempt, node_rank, worker_name, worker_session, gpus, address, state,
                       exit_code, created_at, started_at, finished_at)
SELECT id, 1, 0, 'w' || (id % 100), 's', '[0, 1]'::json, '127.0.0.1', state, exit_code,
       started_at, started_at, finished_at
FROM jobs WHERE name LIKE 'bulk-%'
"""


# ------------------------------------------------------------------------------------------ load


def wrk(url: str, *, method: str, body: str | None, token: str | None, seconds: float) -> dict[str, Any]:
    env = {**os.environ, "WRK_METHOD": method, "WRK_BODY": body or ""}
    argv = [
        "wrk",
        "-t2",
        f"-c{CONNECTIONS}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA),
    ]
    if token:
        argv += ["-H", f"Authorization: Bearer {token}"]
    out = subprocess.run([*argv, url], capture_output=True, text=True, env=env, timeout=seconds + 60)
    line = next((x for x in out.stdout.splitlines() if x.startswith("WRK_JSON ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-1000:]} {out.stderr[-1000:]}")
    raw = json.loads(line.removeprefix("WRK_JSON "))
    errors = sum(raw[k] for k in ("connect", "read", "write", "status", "timeout"))
    return {
        "rps": raw["requests"] / (raw["duration_us"] / 1e6),
        "p50_ms": raw["p50_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "requests": raw["requests"],
        "errors": errors,
        "error_kinds": {k: raw[k] for k in ("connect", "read", "write", "status", "timeout") if raw[k]},
        "tool": "wrk",
    }


def python_load(
    url: str, *, method: str, body: str | None, token: str | None, seconds: float
) -> dict[str, Any]:
    """The smoke run's fallback when wrk is missing: 32 keep-alive connections in threads.
    The client's own GIL caps it: good enough to exercise the path, not to measure."""
    parts = urlsplit(url)
    host = parts.hostname
    if host is None:
        raise ValueError(f"no host in {url!r}")
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    headers = {"Content-Type": "application/json"} if body else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client() -> None:
        conn = http.client.HTTPConnection(host, parts.port, timeout=10)
        mine: list[float] = []
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                ok = resp.status < 400
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(host, parts.port, timeout=10)
                ok = False
            mine.append(time.perf_counter() - t0)
            if not ok:
                with lock:
                    errors[0] += 1
        conn.close()
        with lock:
            latencies.extend(mine)

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else 0.0

    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "requests": len(latencies),
        "errors": errors[0],
        "tool": "python threads (fallback)",
    }


# ------------------------------------------------------------------------------------------ setup


def bulk_insert(pg_url: str, n: int) -> dict[str, int]:
    """`n` finished jobs of the admin user, with their attempts and node rows; (min, mid, max) ids."""
    from sqlalchemy import create_engine, text

    engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            owner: int = conn.execute(text("SELECT id FROM users WHERE name = 'admin'")).scalar_one()
            conn.execute(text(INSERT_JOBS), {"owner": owner, "n": n})
            conn.execute(text(INSERT_ATTEMPTS))
            conn.execute(text(INSERT_NODES))
        # ANALYZE in autocommit: inside a transaction that is never committed its statistics
        # are rolled back, and the planner (autovacuum may be off) then guesses 500 rows per
        # job id and runs parallel scans that a production database would never pick.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in ("jobs", "job_attempts", "node_runs"):
                conn.execute(text(f"ANALYZE {table}"))
            lo: int
            hi: int
            count: int
            lo, hi, count = conn.execute(text("SELECT min(id), max(id), count(*) FROM jobs")).tuples().one()
            succeeded: int = conn.execute(
                text("SELECT max(id) FROM jobs WHERE state = 'succeeded' AND name LIKE 'bulk-%'")
            ).scalar_one()
            running = succeeded - 1
            conn.execute(
                text("UPDATE jobs SET state = 'running', finished_at = NULL WHERE id = :id"),
                {"id": running},
            )
    finally:
        engine.dispose()
    return {
        "min": lo,
        "mid": (lo + hi) // 2,
        "max": hi,
        "count": count,
        "succeeded": succeeded,
        "running": running,
    }


class ProgressWriter:
    """A worker's progress reports on the running job, from another connection, as a worker
    host sends them: each commit changes the job's view, so GETs of it keep missing the
    job-view cache now and then, as they do in production."""

    def __init__(self, pg_url: str, job_id: int, per_s: float) -> None:
        from sqlalchemy import create_engine

        self.engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
        self.job_id, self.per_s = job_id, per_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.writes = 0

    def __enter__(self) -> ProgressWriter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.engine.dispose()

    def _run(self) -> None:
        from sqlalchemy import text

        while not self._stop.wait(1.0 / self.per_s):
            self.writes += 1
            progress = json.dumps({"epoch": 1, "epochs": 10, "step": self.writes, "total_steps": 10**6})
            with self.engine.begin() as conn:
                conn.execute(
                    text("UPDATE jobs SET progress = CAST(:p AS json) WHERE id = :id"),
                    {"p": progress, "id": self.job_id},
                )


def start_bare(
    scratch: Path, *files: Path, env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m bench.bare_app PORT [PAGE_JSON [SERIES_JSON...]]`, once it answers; `env`
    adds to this process's environment (bench/submit.py names its database there)."""
    port = harness.free_port()
    log = open(scratch / "bare_app.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.bare_app", str(port), *map(str, files)],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/v1/things/1", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    harness.wait_for(up, 60, "the bare FastAPI app")
    return proc, url


# ------------------------------------------------------------------------------------------ the driver


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--jobs", type=int, default=100_000, help="rows in the jobs table")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="of each wrk run")
    parser.add_argument("--artifacts", type=Path, default=REPO / "test-artifacts" / "bench" / "api")
    args = parser.parse_args(argv)
    if args.smoke:
        args.jobs, args.runs, args.seconds = 500, 1, 1.0
    have_wrk = shutil.which("wrk") is not None
    if not have_wrk and not args.smoke:
        sys.exit("wrk is not installed: run bench/setup.sh (only --smoke falls back to a Python client)")
    load = wrk if have_wrk else python_load
    token = harness.ADMIN_TOKEN

    with (
        workdir("tj-bench-api-", keep_on_error=args.artifacts) as scratch,
        production_stack(scratch / "postgres", {}) as (stack, pg_url),
    ):
        t0 = time.monotonic()
        ids = bulk_insert(pg_url, args.jobs)
        insert_s = time.monotonic() - t0
        print(f"inserted {args.jobs} jobs in {insert_s:.1f} s: {ids}", file=sys.stderr, flush=True)
        page = httpx.get(f"{stack.url}/v1/jobs", headers=harness.auth(token), timeout=60)
        page.raise_for_status()
        (scratch / "page.json").write_bytes(page.content)
        bare, bare_url = start_bare(scratch, scratch / "page.json")
        if httpx.get(f"{bare_url}/v1/things", timeout=30).json() != page.json():
            raise RuntimeError("the bare list's floor does not answer the same JSON")
        try:
            svc = stack.url
            body = json.dumps(JOB_SPEC)
            cases: dict[str, list[tuple[str, str, str, str | None, str | None]]] = {
                # name: [(side, url, method, body, token)...], measured in turn each round
                "get": [
                    ("service", f"{svc}/v1/jobs/{ids['succeeded']}", "GET", None, token),
                    ("running", f"{svc}/v1/jobs/{ids['running']}", "GET", None, token),
                    ("bare", f"{bare_url}/v1/things/{ids['succeeded']}", "GET", None, token),
                    ("bare async", f"{bare_url}/v1/async-things/{ids['succeeded']}", "GET", None, token),
                ],
                "list": [
                    ("first", f"{svc}/v1/jobs", "GET", None, token),
                    ("middle", f"{svc}/v1/jobs?cursor={ids['mid']}", "GET", None, token),
                    ("deep", f"{svc}/v1/jobs?cursor={ids['min'] + 51}", "GET", None, token),
                    ("bare", f"{bare_url}/v1/things", "GET", None, token),
                ],
                "post": [
                    ("service", f"{svc}/v1/jobs", "POST", body, token),
                    ("bare", f"{bare_url}/v1/things", "POST", body, token),
                ],
            }
            for side in cases["get"] + cases["post"]:  # sanity: each answers 2xx
                resp = httpx.request(
                    side[2],
                    side[1],
                    content=side[3],
                    timeout=30,
                    headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                )
                if resp.status_code >= 300:
                    raise RuntimeError(f"{side[2]} {side[1]}: {resp.status_code} {resp.text[:300]}")
            results: dict[str, dict[str, list[dict[str, Any]]]] = {}
            writer = ProgressWriter(pg_url, ids["running"], PROGRESS_WRITES_PER_S)
            with writer:
                measure(cases, results, args, load)
            lags = {"cache": visibility(svc, pg_url, ids, token, args, load)}
            with uncached_server(stack) as off:
                results["get"]["cache off"] = [
                    load(f"{off}/v1/jobs/{ids['succeeded']}", method="GET", body=None, token=token, seconds=s)
                    for s in [args.seconds] * args.runs
                ]
                lags["cache off"] = visibility(off, pg_url, ids, token, args, load)
        finally:
            bare.terminate()
            bare.wait(timeout=15)

    result = make_result(results, args, ids, insert_s, load is wrk, lags)
    write_result(args.json, result)
    print_figures(result)
    return 0


def measure(
    cases: dict[str, list[tuple[str, str, str, str | None, str | None]]],
    results: dict[str, dict[str, list[dict[str, Any]]]],
    args: argparse.Namespace,
    load: Any,
) -> None:
    """Each case's sides in turn, rotating who goes first each round."""
    for name, sides in cases.items():
        for _, url, method, b, tok in sides if not args.smoke else []:  # warm-up, not counted
            load(url, method=method, body=b, token=tok, seconds=2.0)
        for i in range(args.runs):
            for side, url, method, b, tok in sides[i % len(sides) :] + sides[: i % len(sides)]:
                r = load(url, method=method, body=b, token=tok, seconds=args.seconds)
                results.setdefault(name, {}).setdefault(side, []).append(r)
                print(
                    f"  {name} {side} run {i + 1}: {r['rps']:.0f} req/s p50 {r['p50_ms']:.1f} ms "
                    f"p99 {r['p99_ms']:.1f} ms errors {r['errors']}",
                    file=sys.stderr,
                    flush=True,
                )


@contextlib.contextmanager
def uncached_server(stack: harness.Stack) -> Iterator[str]:
    """A second `torchjobs server` (API only) on the same database with the job-view cache
    off: what every GET cost before it, and the staleness floor of reading the database."""
    port = harness.free_port()
    stack._spawn(
        "server-cache-off",
        ["server", "--no-scheduler", "--port", str(port)],
        {"TORCHJOBS_JOB_VIEW_CACHE_TTL_S": "0"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        harness.wait_for(lambda: _healthy(url), 60, "the cache-off server")
        yield url
    finally:
        proc = stack.procs.pop("server-cache-off")
        proc.terminate()
        proc.wait(timeout=15)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def visibility(
    svc: str, pg_url: str, ids: dict[str, int], token: str, args: argparse.Namespace, load: Any
) -> dict[str, list[float]]:
    """How long a commit made elsewhere (a worker's progress report) takes to show on
    `GET /v1/jobs/{id}`: the job-view cache's staleness, which the NOTIFY's delivery bounds.
    Measured with the server idle, and while wrk loads it with GETs of another job."""
    lags: dict[str, list[float]] = {}
    n = 5 if args.smoke else VISIBILITY_SAMPLES
    lags["idle"] = commit_to_get(svc, pg_url, ids["running"], token, n)
    loader = threading.Thread(
        target=load,
        args=(f"{svc}/v1/jobs/{ids['succeeded']}",),
        kwargs={"method": "GET", "body": None, "token": token, "seconds": max(3.0, args.seconds)},
    )
    loader.start()
    time.sleep(1.0)
    lags["loaded"] = commit_to_get(svc, pg_url, ids["running"], token, n)
    loader.join()
    return lags


def commit_to_get(svc: str, pg_url: str, job_id: int, token: str, n: int) -> list[float]:
    from sqlalchemy import create_engine, text

    engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    lags = []
    try:
        with httpx.Client(base_url=svc, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
            for k in range(n):
                marker = 10**8 + k + int(time.time() * 1000) % 10**7
                client.get(f"/v1/jobs/{job_id}")  # cached before the change
                with engine.begin() as conn:
                    conn.execute(
                        text("UPDATE jobs SET progress = CAST(:p AS json) WHERE id = :id"),
                        {"p": json.dumps({"step": marker, "total_steps": 10**9}), "id": job_id},
                    )
                committed = time.perf_counter()
                while client.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] != marker:
                    if time.perf_counter() - committed > 30:
                        raise RuntimeError("a commit did not reach GET /v1/jobs/{id} in 30 s")
                lags.append((time.perf_counter() - committed) * 1000)
                time.sleep(0.05)
    finally:
        engine.dispose()
    return lags


def make_result(
    results: dict[str, dict[str, list[dict[str, Any]]]],
    args: argparse.Namespace,
    ids: dict[str, int],
    insert_s: float,
    used_wrk: bool,
    lags: dict[str, dict[str, list[float]]],
) -> dict[str, Any]:
    def col(name: str, side: str, key: str) -> list[float]:
        return [r[key] for r in results[name][side]]

    setup = f"PostgreSQL, {ids['count']:,} jobs"
    figs = []
    for name, side, label, floor_label, target in (
        ("get", "service", "GET /v1/jobs/{id}", "bare FastAPI GET", ">= 0.5"),
        ("post", "service", "POST /v1/jobs", "bare FastAPI POST (pydantic body)", ">= 0.25"),
        ("list", "first", "GET /v1/jobs (50 a page)", "bare FastAPI GET of the same page's JSON", ">= 0.5"),
    ):
        figs.append(
            figure(
                f"{label} requests/s",
                "req/s",
                col(name, side, "rps"),
                col(name, "bare", "rps"),
                setup=setup,
                floor_name=floor_label,
                target=target,
            )
        )
        for q in ("p50", "p99"):
            figs.append(
                figure(
                    f"{label} {q} latency",
                    "ms",
                    col(name, side, f"{q}_ms"),
                    col(name, "bare", f"{q}_ms"),
                    setup=setup,
                    floor_name=floor_label,
                )
            )
    figs.append(
        figure(
            "GET /v1/jobs/{id} requests/s, against an async floor",
            "req/s",
            col("get", "service", "rps"),
            col("get", "bare async", "rps"),
            setup=setup,
            floor_name="bare FastAPI GET, async def (no thread hop)",
        )
    )
    for q, unit, key in (("requests/s", "req/s", "rps"), ("p50 latency", "ms", "p50_ms")):
        figs.append(
            figure(
                f"GET /v1/jobs/{{id}} {q}, a running job",
                unit,
                col("get", "running", key),
                col("get", "bare", key),
                setup=f"{setup}, its progress written {PROGRESS_WRITES_PER_S:.0f}/s",
                floor_name="bare FastAPI GET",
                target=">= 0.5" if key == "rps" else "",
            )
        )
    figs.append(
        figure(
            "GET /v1/jobs/{id} requests/s, job-view cache off",
            "req/s",
            col("get", "cache off", "rps"),
            col("get", "bare", "rps"),
            setup=setup,
            floor_name="bare FastAPI GET",
            paired=False,
            note="TORCHJOBS_JOB_VIEW_CACHE_TTL_S=0: every GET reads the database (5 queries)",
        )
    )
    for when, label in (("idle", "server idle"), ("loaded", f"server under {CONNECTIONS} GET clients")):
        figs.append(
            figure(
                f"commit elsewhere -> seen by GET /v1/jobs/{{id}}, {label}",
                "ms",
                lags["cache"][when],
                lags["cache off"][when],
                setup="PostgreSQL (NOTIFY)",
                floor_name="the same with the cache off",
                paired=False,
                note="the cache's staleness, including the GET that sees the change",
            )
        )
    for page in ("middle", "deep"):
        figs.append(
            figure(
                f"GET /v1/jobs {page} page (cursor) requests/s",
                "req/s",
                col("list", page, "rps"),
                col("list", "first", "rps"),
                setup=setup,
                floor_name="GET /v1/jobs first page",
                target="~1.0 (flat)",
            )
        )
        figs.append(
            figure(
                f"GET /v1/jobs {page} page p50 latency",
                "ms",
                col("list", page, "p50_ms"),
                col("list", "first", "p50_ms"),
                setup=setup,
                floor_name="GET /v1/jobs first page",
            )
        )
    errors = {
        f"{name} {side}": sum(r["errors"] for r in runs)
        for name, sides in results.items()
        for side, runs in sides.items()
    }
    tool = "wrk -t2 -c32" if used_wrk else "a Python thread client (smoke fallback: wrk missing)"
    notes = [
        f"{tool}, {args.runs} run(s) x {args.seconds:.0f} s per endpoint, {CONNECTIONS} connections",
        f"{ids['count']:,} jobs in the table ({args.jobs:,} bulk-inserted in {insert_s:.1f} s); "
        f"list pages of 50: first, cursor={ids['mid']} (middle), cursor={ids['min'] + 51} (oldest)",
        f"GET /v1/jobs/{{id}}: succeeded job {ids['succeeded']}, and running job {ids['running']} whose "
        f"progress another connection updates {PROGRESS_WRITES_PER_S:.0f} times a second throughout "
        "(each update invalidates its cached view: service/jobs/view_cache.py)",
    ]
    if any(errors.values()):
        notes.append("non-2xx or socket errors: " + ", ".join(f"{k}: {v}" for k, v in errors.items() if v))
    lines = [
        "| endpoint | side | req/s | p50 ms | p99 ms |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, sides in results.items():
        for side, runs in sides.items():
            med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in ("rps", "p50_ms", "p99_ms")}
            lines.append(
                f"| {name} | {side} | {med['rps']:.0f} | {med['p50_ms']:.1f} | {med['p99_ms']:.1f} |"
            )
    return {
        "name": "api",
        "title": "API on PostgreSQL: torchjobs against a bare FastAPI endpoint (32 connections)",
        "figures": figs,
        "details": "Medians per endpoint:\n\n" + "\n".join(lines),
        "notes": notes,
        "raw": results,
    }


if __name__ == "__main__":
    raise SystemExit(main())
