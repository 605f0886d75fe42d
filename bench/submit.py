"""`POST /v1/jobs` with one API process and with `server --workers 2`, against two floors (#42).

    bench/setup.sh                                  # installs wrk (idempotent)
    .venv/bin/python -m bench.submit                # 3 rounds x 10 s per side, ~4 min
    .venv/bin/python -m bench.submit --smoke        # 1 round x 1 s; Python load if no wrk

What runs: `torchjobs db upgrade` + `torchjobs server` on a fresh PostgreSQL database, no
worker (submitted jobs queue, the scheduler runs as in production), restarted between
`--workers 1` and `--workers 2` each round; and `bench/bare_app.py` served by uvicorn as
`torchjobs server` serves its app, with two floors: `POST /v1/things` (the same body parsed
by pydantic, nothing stored) and `POST /v1/inserted-things` (the same body parsed, then a job
row and its first event inserted in one transaction with the same driver: the floor that
matters). wrk `-t2 -c32` loads one side at a time with the same body and token; the order
rotates each round. The queue grows by every job posted (no worker takes them), for every
side alike, so sides measured later in a round post into a longer queue.

wrk, the server, the floor and PostgreSQL share the machine's cores: on 2 cores a second API
process competes with PostgreSQL and wrk, so what `--workers 2` gains here is a lower bound
of what it gains on a host with cores to spare.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any

import httpx

from bench.api import JOB_SPEC, python_load, start_bare, wrk
from bench.common import figure, print_figures, production_stack, workdir, write_result
from service.testing import harness

SIDES = ("service", "service --workers 2", "bare POST", "bare INSERT")
TOKEN = harness.ADMIN_TOKEN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="of each wrk run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.seconds = 1, 1.0
    have_wrk = shutil.which("wrk") is not None
    if not have_wrk and not args.smoke:
        sys.exit("wrk is not installed: run bench/setup.sh (only --smoke falls back to a Python client)")
    load = wrk if have_wrk else python_load
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    body = json.dumps(JOB_SPEC)
    with workdir("tj-bench-submit-") as scratch, production_stack(scratch / "home", {}) as (stack, pg_url):
        bare, bare_url = start_bare(scratch, env={"TJ_BENCH_DATABASE_URL": pg_url})
        try:
            urls = {
                "service": f"{stack.url}/v1/jobs",
                "service --workers 2": f"{stack.url}/v1/jobs",
                "bare POST": f"{bare_url}/v1/things",
                "bare INSERT": f"{bare_url}/v1/inserted-things",
            }
            for i in range(args.runs):
                for side in SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]:
                    if side.startswith("service"):
                        serve_with(stack, 2 if "--workers" in side else 1)
                    check(urls[side])
                    load(urls[side], method="POST", body=body, token=TOKEN, seconds=1.0)  # warm-up
                    r = load(urls[side], method="POST", body=body, token=TOKEN, seconds=args.seconds)
                    runs[side].append(r)
                    print(
                        f"  {side} run {i + 1}: {r['rps']:.0f} req/s p50 {r['p50_ms']:.1f} ms"
                        f" errors {r['errors']} {r.get('error_kinds') or ''}",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            bare.terminate()
            bare.wait(timeout=15)
    result = make_result(runs, args, load is wrk)
    write_result(args.json, result)
    print_figures(result)
    return 0


def serve_with(stack: harness.Stack, processes: int) -> None:
    """The stack's server restarted with `--workers processes`, when it runs with another number."""
    wanted = ("--workers", str(processes)) if processes > 1 else ()
    if stack.server_args == wanted and stack.procs["server"].poll() is None:
        return
    server = stack.procs.pop("server")
    server.terminate()
    server.wait(timeout=60)
    log = stack.home / "server.log"
    before = log.read_text(errors="replace").count("API up")
    stack.server_args = wanted
    stack.start_server()
    # every process up, not only the first to answer
    harness.wait_for(lambda: log.read_text(errors="replace").count("API up") >= before + processes, 120, "up")


def check(url: str) -> None:
    answer = httpx.post(url, json=JOB_SPEC, headers=harness.auth(TOKEN), timeout=30)
    if answer.status_code != 201:
        raise RuntimeError(f"POST {url}: {answer.status_code} {answer.text[:300]}")


def make_result(
    runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, with_wrk: bool
) -> dict[str, Any]:
    def rps(side: str) -> list[float]:
        return [r["rps"] for r in runs[side]]

    figures = []
    for side in ("service", "service --workers 2"):
        for floor, what, target in (
            ("bare POST", "bare FastAPI POST, nothing stored", ">= 0.25"),
            ("bare INSERT", "bare FastAPI POST + the same INSERTs", ">= 0.5"),
        ):
            figures.append(
                figure(
                    f"POST /v1/jobs requests/s, {side.replace('service', 'torchjobs server')}",
                    " req/s",
                    rps(side),
                    rps(floor),
                    setup=f"PostgreSQL, {'wrk -t2 -c32' if with_wrk else 'Python load'}",
                    floor_name=what,
                    target=target,
                )
            )
    notes = [
        f"{args.runs} rounds of {args.seconds:g} s per side, the order rotating each round; the server"
        " restarted between 1 and 2 processes; the queue grows by every job posted (no worker)",
        "the floor that matters is the bare INSERT: a job row and its first event in one transaction,"
        " with the same driver and no token, validation, quota or ORM",
    ]
    return {
        "name": "submit",
        "title": "POST /v1/jobs with one and two API processes, against a bare POST and a bare INSERT",
        "figures": figures,
        "notes": notes,
        "raw": runs,
    }


if __name__ == "__main__":
    raise SystemExit(main())
