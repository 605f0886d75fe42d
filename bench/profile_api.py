"""Where an API request's time goes: `torchjobs server` sampled by py-spy under wrk load.

    bench/setup.sh && .venv/bin/pip install py-spy     # wrk, and the profiler (not in the lock)
    .venv/bin/python -m bench.profile_api               # POST /v1/jobs and GET /v1/jobs, ~2 min
    .venv/bin/python -m bench.profile_api --route post --seconds 20

The same deployment as `bench/api.py` (`torchjobs db upgrade` + `torchjobs server` on a fresh
PostgreSQL database and Redis, no worker, `--jobs` finished jobs inserted first), loaded by wrk
at 32 connections. Meanwhile py-spy samples the server process with `--gil`: only the thread
holding the GIL, so a sample is the server's Python CPU, not a thread waiting on PostgreSQL.
Printed, per route: requests/s; the server's and PostgreSQL's CPU per request (from `/proc`);
the share of GIL samples in each package (by the innermost frame); and the torchjobs and
SQLAlchemy functions with the largest inclusive share. The statements a request sends are
counted by `tests/service/jobs/test_request_queries.py`, not here.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.api import JOB_SPEC, bulk_insert, wrk
from bench.common import production_stack, workdir
from service.testing import harness

PACKAGES = ("service", "workers", "fastapi", "starlette", "uvicorn", "sqlalchemy", "psycopg", "pydantic")
HZ = 250


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", choices=("post", "list", "both"), default="both")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--jobs", type=int, default=100_000)
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists() or shutil.which("wrk") is None:
        sys.exit("needs wrk (bench/setup.sh) and py-spy (.venv/bin/pip install py-spy)")
    token = harness.ADMIN_TOKEN
    with workdir("tj-bench-profile-") as scratch, production_stack(scratch / "home", {}) as (stack, pg_url):
        httpx.get(f"{stack.url}/v1/jobs", headers=harness.auth(token), timeout=60).raise_for_status()
        bulk_insert(pg_url, args.jobs)
        server = stack.procs["server"].pid
        routes = ("list", "post") if args.route == "both" else (args.route,)
        for route in routes:
            method, body = ("POST", json.dumps(JOB_SPEC)) if route == "post" else ("GET", None)
            url = f"{stack.url}/v1/jobs"
            wrk(url, method=method, body=body, token=token, seconds=3)  # warm-up
            print(f"\n## {method} /v1/jobs, wrk -c32, {args.seconds:.0f} s, {args.jobs:,} jobs\n")
            print_profile(*profiled(spy, server, url, method, body, token, args.seconds))
    return 0


def profiled(
    spy: str, pid: int, url: str, method: str, body: str | None, token: str, seconds: float
) -> tuple[dict[str, Any], dict[str, float], str]:
    raw = Path(tempfile.mkdtemp(prefix="tj-spy-")) / "samples.txt"
    sampler = subprocess.Popen(
        [spy, "record", "-p", str(pid), "-d", str(int(seconds) - 1), "-r", str(HZ), "--gil", "--nonblocking"]
        + ["--format", "raw", "-o", str(raw)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    before = {"server": cpu_seconds([pid]), "postgres": cpu_seconds(postgres_pids())}
    load = wrk(url, method=method, body=body, token=token, seconds=seconds)
    after = {"server": cpu_seconds([pid]), "postgres": cpu_seconds(postgres_pids())}
    sampler.wait(timeout=60)
    cpu = {k: (after[k] - before[k]) / max(1, load["requests"]) * 1000 for k in before}
    return load, cpu, raw.read_text() if raw.exists() else ""


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes (all their threads), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def postgres_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "postgres":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def print_profile(load: dict[str, Any], cpu: dict[str, float], samples: str) -> None:
    print(f"{load['rps']:.0f} req/s, p50 {load['p50_ms']:.1f} ms, p99 {load['p99_ms']:.1f} ms")
    print(f"CPU per request: server {cpu['server']:.2f} ms, PostgreSQL {cpu['postgres']:.2f} ms\n")
    inclusive, innermost, total = tally(samples)
    if not total:
        print("(no samples: py-spy could not attach; run as root or allow ptrace)")
        return
    print("| package (innermost frame) | share of GIL samples |\n| --- | ---: |")
    for package, count in innermost.most_common():
        print(f"| {package} | {100 * count / total:.1f}% |")
    print("\n| function (inclusive) | share of GIL samples |\n| --- | ---: |")
    ours = [
        (f, c)
        for f, c in inclusive.most_common()
        if f.startswith(("service/", "sqlalchemy/orm")) and not f.startswith("service/cli/")  # (the root)
    ]
    for function, count in ours[:25]:
        print(f"| `{function}` | {100 * count / total:.1f}% |")


def tally(samples: str) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    """(inclusive samples per function, samples per package of the innermost frame, total)."""
    inclusive: collections.Counter[str] = collections.Counter()
    innermost: collections.Counter[str] = collections.Counter()
    total = 0
    for line in samples.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame_name(f) for f in stack.split(";") if not f.startswith("thread (")]
        if not frames:
            continue
        total += count
        for name in set(frames):
            inclusive[name] += count
        innermost[package_of(frames[-1])] += count
    return inclusive, innermost, total


def frame_name(frame: str) -> str:
    """`func (path/to/site-packages/pkg/mod.py:12)` -> `pkg/mod.py func`."""
    match = re.match(r"(.*) \((?:.*/site-packages/)?([^()]*?)(?::\d+)?\)$", frame)
    return f"{match.group(2)} {match.group(1)}" if match else frame


def package_of(name: str) -> str:
    top = name.split("/", 1)[0]
    return top if top in PACKAGES else "other (asyncio, threading, json, the standard library...)"


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"\n{time.monotonic() - started:.0f} s", file=sys.stderr)
    sys.exit(code)
