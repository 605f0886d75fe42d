"""Launch latency, whole-job wall time and training throughput: the service against torchrun by hand.

    .venv/bin/python -m bench.launch                 # both setups, single and ddp x2, ~15 min
    .venv/bin/python -m bench.launch --smoke         # embedded, single, one launch: the code path only

Same trainer, same spec, same machine, in the same run:

* the floor is `python -m torch.distributed.run --nproc-per-node=N --master-port=P
  -m workers.runtime.trainer.train --config CONFIG.json`, started by hand with TORCHJOBS_EVENTS and
  TORCHJOBS_CHECKPOINT_DIR set, the config being what the worker writes for the job
  (workers/launcher/command.py `trainer_config`);
* the service is a real stack: `torchjobs up --gpus 2 --accelerator cpu` (SQLite, embedded
  broker), and `torchjobs db upgrade` + `server` + `worker --accelerator cpu --gpus 2` on
  PostgreSQL + Redis, with the product's default settings.

Launch: from the moment before `POST /v1/jobs` (before `Popen` for the floor) to the first
completed optimizer step on rank 0, i.e. the rank's own wall-clock timestamp of its first
progress report with `step >= 1` (`report_every: 1`). Through the service that timestamp is the
event's `data.reported_at` (the rank's clock, kept by the ingestion), never the time the event
was stored. One epoch of `digits`, `single` and `ddp` on 2 processes.

Whole job: a job of about a minute (ddp x2, `synthetic`): POST -> `finished_at` of the
succeeded job, against Popen -> exit of the bare torchrun. Throughput: the median
`samples_per_sec` of those jobs' progress reports after the first epoch (windows of 10 steps,
validation and checkpointing excluded); the last epoch's figure is kept in the details.

Each stack first runs one job and one bare torchrun that are not counted (page cache, the
worker's first import). Service and bare runs alternate, the one going first swapping every
round, so drift in a shared machine's speed hits both alike; ratios are per pair of runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    all_events,
    embedded_stack,
    failure_notes,
    figure,
    parse_ts,
    print_figures,
    production_stack,
    summary,
    workdir,
    write_result,
)
from service.testing import harness
from workers.launcher import lifeline

BASE_HYPER = {
    "batch_size": 64,
    "lr": 0.001,
    "weight_decay": 0.001,
    "optimizer": "adamw",
    "seed": 0,
    "num_workers": 2,
    "checkpoint_every": 1,
}


def launch_job(mode: str) -> dict[str, Any]:
    """One epoch of digits, a progress report after every step."""
    return {
        "name": f"bench-launch-{mode}",
        "mode": mode,
        "gpus_per_node": 2 if mode == "ddp" else 1,
        "entrypoint": {"kind": "builtin", "model": "cnn", "dataset": "digits"},
        "hyperparameters": {**BASE_HYPER, "epochs": 1, "report_every": 1},
    }


def long_job(mode: str, synthetic_size: int, epochs: int) -> dict[str, Any]:
    """About a minute of training on this machine (default sizes), reports at the default rate."""
    return {
        "name": f"bench-long-{mode}",
        "mode": mode,
        "gpus_per_node": 2 if mode == "ddp" else 1,
        "entrypoint": {"kind": "builtin", "model": "cnn", "dataset": "synthetic"},
        "hyperparameters": {
            **BASE_HYPER,
            "epochs": epochs,
            "synthetic_size": synthetic_size,
            "report_every": 10,
        },
    }


def trainer_config(spec: dict[str, Any]) -> dict[str, Any]:
    """What the worker writes to config.json for this spec (workers/launcher/command.py)."""
    return {
        "mode": spec["mode"],
        "accelerator": "cpu",
        "gpus_per_node": spec["gpus_per_node"],
        "entrypoint": spec["entrypoint"],
        "hyperparameters": spec["hyperparameters"],
    }


# ------------------------------------------------------------------------------------------ one run


def first_step_ts(reports: list[dict[str, Any]], key: str) -> float | None:
    for r in reports:
        if isinstance(r.get("step"), int) and r["step"] >= 1 and r.get(key) is not None:
            return float(r[key])
    return None


def last_report_ts(reports: list[dict[str, Any]], key: str) -> float | None:
    stamps = [float(r[key]) for r in reports if r.get(key) is not None]
    return max(stamps) if stamps else None


def last_throughput(reports: list[dict[str, Any]]) -> float | None:
    values = [r["samples_per_sec"] for r in reports if r.get("samples_per_sec") is not None]
    return float(values[-1]) if values else None


def steady_throughput(reports: list[dict[str, Any]]) -> float | None:
    """Median samples/s of the in-epoch report windows (`report_every` steps each) after the
    first epoch: the steady state, ~100 windows of a one-minute job, where the last epoch's
    single figure is one ~10 s window that a neighbour's burst on this shared machine can sink.
    Epoch-end reports (they carry `val_loss`) are whole-epoch averages and are left out. Falls
    back to the last report's figure for a job too short to have such windows."""
    windows = [
        float(r["samples_per_sec"])
        for r in reports
        if r.get("samples_per_sec") is not None and "val_loss" not in r and (r.get("epoch") or 0) >= 1
    ]
    return statistics.median(windows) if windows else last_throughput(reports)


Launcher = Callable[[list[str], dict[str, str], Path], tuple[list[str], dict[str, str]]]


def run_bare(
    spec: dict[str, Any], where: Path, timeout: float, launcher: Launcher | None = None
) -> dict[str, Any]:
    """torchrun by hand: (first step s, wall s, samples/s). `launcher` may rewrite the command
    line and environment (bench/sandbox.py runs the same torchrun inside bubblewrap)."""
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps(trainer_config(spec)))
    events = where / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHJOBS_")}
    env.update(
        TORCHJOBS_EVENTS=str(events),
        TORCHJOBS_CHECKPOINT_DIR=str(where / "checkpoints"),
        OMP_NUM_THREADS="1",  # what the worker's ranks get too (and torchrun's own default)
        PYTHONPATH=str(REPO),
    )
    nproc = spec["gpus_per_node"] if spec["mode"] == "ddp" else 1
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={harness.free_port()}",
        "-m",
        "workers.runtime.trainer.train",
        "--config",
        str(where / "config.json"),
    ]
    if launcher is not None:
        argv, env = launcher(argv, env, where)
    with open(where / "torchrun.log", "wb") as log:
        t0 = time.time()
        proc = subprocess.Popen(  # a sandbox (`launcher`) refuses to start without its lifeline
            argv,
            env=env,
            cwd=where,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=lifeline.pass_fds() if launcher is not None else (),
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"bare torchrun still running after {timeout:.0f} s: killed") from None
        t_exit = time.time()
    if rc != 0:
        raise RuntimeError(f"bare torchrun exited {rc}: {(where / 'torchrun.log').read_text()[-2000:]}")
    reports = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    first, last = first_step_ts(reports, "ts"), last_report_ts(reports, "ts")
    return {
        "first_step_s": None if first is None else first - t0,
        "last_report_s": None if last is None else last - t0,
        "wall_s": t_exit - t0,
        "samples_per_sec": steady_throughput(reports),
        "last_epoch_samples_per_sec": last_throughput(reports),
    }


# How often the benchmark asks whether its job has ended. What it measures does not depend on
# it (first step and throughput come from the rank's own reports, the wall time from the job's
# `finished_at`), but each look costs CPU on the cores the job trains on, on the service's
# side only: bare torchrun's side just waits for the process. So: rarely, one connection.
WAIT_POLL_S = 2.0


def run_service(stack: harness.Stack, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Through the API: (first step s, wall s, samples/s) and where the launch time went."""
    with stack.client() as c:
        t0 = time.time()
        resp = c.post("/v1/jobs", json=spec)
    if resp.status_code != 201:
        raise RuntimeError(f"POST /v1/jobs: {resp.status_code} {resp.text}")
    job_id = resp.json()["id"]
    try:
        job = stack.wait_job(job_id, timeout=timeout, interval=WAIT_POLL_S)
    except TimeoutError:
        with stack.client() as c:
            c.post(f"/v1/jobs/{job_id}/cancel")
        stack.wait_job(job_id, timeout=120)
        raise RuntimeError(f"job {job_id} still not done after {timeout:.0f} s: cancelled") from None
    if job["state"] != "succeeded":
        raise RuntimeError(f"job {job['id']} {job['state']}: {job.get('error')}")
    events = all_events(stack, job["id"])
    reports = [e["data"] for e in events if e["type"] == "progress"]
    first = first_step_ts(reports, "reported_at")
    clock = "rank"
    if first is None:  # an ingestion that drops the rank's clock: the storing time, later
        stored = [parse_ts(e["ts"]) for e in events if e["type"] == "progress" and e["data"].get("step")]
        first, clock = (stored[0] if stored else None), "stored"
    states = {e["data"]["state"]: parse_ts(e["ts"]) for e in events if e["type"] == "state"}
    last = last_report_ts(reports, "reported_at")
    return {
        "first_step_s": None if first is None else first - t0,
        "last_report_s": None if last is None else last - t0,
        "wall_s": parse_ts(job["finished_at"]) - t0,
        "samples_per_sec": steady_throughput(reports),
        "last_epoch_samples_per_sec": last_throughput(reports),
        "clock": clock,
        "to_scheduled_s": states.get("scheduled", t0) - t0,
        "to_running_s": states.get("running", t0) - t0,
    }


# ------------------------------------------------------------------------------------------ the driver


def bench_setup(
    setup: str, stack: harness.Stack, args: argparse.Namespace, scratch: Path
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{kind: {"service": [...], "bare": [...]}} for kind in launch-<mode>, long-<mode>."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    counter = iter(range(1_000_000))

    def pair(kind: str, spec: dict[str, Any], i: int, timeout: float) -> None:
        sides = [
            ("service", lambda: run_service(stack, spec, timeout)),
            ("bare", lambda: run_bare(spec, scratch / f"{setup}-{kind}-{next(counter)}", timeout)),
        ]
        for side, fn in sides if i % 2 == 0 else sides[::-1]:
            try:
                result = fn()
            except Exception as exc:  # a failed run is recorded, the others go on
                result = {"error": str(exc)[-1500:]}
            out.setdefault(kind, {}).setdefault(side, []).append(result)
        print(f"  {setup} {kind} run {i + 1}: " + describe(out[kind], -1), file=sys.stderr, flush=True)

    if args.warmup:  # not counted: the worker's first job and the page cache of a first torchrun
        run_service(stack, launch_job("single"), 300)
        run_bare(launch_job("single"), scratch / f"{setup}-warmup", 300)
    for i in range(args.runs):
        for mode in args.modes:
            pair(f"launch-{mode}", launch_job(mode), i, 300)
    for i in range(args.long_runs):
        for mode in args.long_modes:
            pair(f"long-{mode}", long_job(mode, args.synthetic_size, args.epochs), i, 900)
    return out


def describe(sides: dict[str, list[dict[str, Any]]], i: int) -> str:
    parts = []
    for side, runs in sides.items():
        r = runs[i]
        if "error" in r:
            parts.append(f"{side}: FAILED {r['error'][-300:]}")
            continue
        parts.append(
            f"{side}: first step {r['first_step_s']:.2f}s wall {r['wall_s']:.1f}s "
            f"{(r['samples_per_sec'] or 0):.0f} samples/s"
        )
    return "; ".join(parts)


def figures_for(setup: str, data: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    figs = []
    for kind, sides in data.items():
        mode = kind.split("-", 1)[1]
        label = "ddp x2" if mode == "ddp" else mode
        ok = [
            j
            for j, (a, b) in enumerate(zip(sides["service"], sides["bare"], strict=True))
            if not {"error"} & {*a, *b}
        ]
        svc, bare = [sides["service"][j] for j in ok], [sides["bare"][j] for j in ok]
        failed = len(sides["service"]) - len(ok)
        if not ok:
            continue
        dropped = f"{failed} run pair(s) left out: a side failed (see the notes)" if failed else ""
        if kind.startswith("launch"):
            clocks = {r["clock"] for r in svc}
            note = "" if clocks == {"rank"} else "service timestamps are storing times (rank clock dropped)"
            note = "; ".join(x for x in (note, dropped) if x)
            measures = [("launch: POST -> first step", "s", "first_step_s", "<= 1.0", note)]
        else:
            measures = [
                ("whole job (~1 min)", "s", "wall_s", "<= 1.02", dropped),
                ("training throughput", "samples/s", "samples_per_sec", ">= 0.98", dropped),
            ]
        for title, unit, key, target, note in measures:
            figs.append(
                figure(
                    f"{title}, {label}",
                    unit,
                    [r[key] for r in svc],
                    [r[key] for r in bare],
                    setup=setup,
                    floor_name="torchrun by hand",
                    target=target,
                    note=note,
                )
            )
    return figs


def details(results: dict[str, dict[str, dict[str, list[dict[str, Any]]]]]) -> str:
    """Where the service's launch time goes (medians)."""
    rows = [
        "Where the launch time goes through the service (medians, seconds from the POST; the first "
        "two are the `state` events' storing times, the last the rank's own clock):",
        "",
        "| setup | job | -> `scheduled` | -> `running` | -> first step | bare torchrun -> first step |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for setup, data in results.items():
        for kind, sides in data.items():
            if not kind.startswith("launch"):
                continue
            svc = [r for r in sides["service"] if "error" not in r]

            def med(key: str, runs: list[dict[str, Any]] = svc) -> str:
                value = summary([r[key] for r in runs if "error" not in r])["median"]
                return "–" if value is None else f"{value:.2f}"

            rows.append(
                f"| {setup} | {kind.split('-', 1)[1]} | {med('to_scheduled_s')} | {med('to_running_s')} "
                f"| {med('first_step_s')} | {med('first_step_s', sides['bare'])} |"
            )
    rows += [
        "",
        "Where the whole job's time goes (medians, seconds from the POST or the Popen; the first "
        "two on the rank's own clock, the end is `finished_at` through the service and the exit "
        "of torchrun by hand):",
        "",
        "| setup | side | -> first step | first step -> last report | last report -> end | whole |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for setup, data in results.items():
        for kind, sides in data.items():
            if not kind.startswith("long"):
                continue
            for side in ("service", "bare"):
                runs = [r for r in sides[side] if "error" not in r and r.get("last_report_s") is not None]

                def span(a: str, b: str | None, runs: list[dict[str, Any]] = runs) -> str:
                    value = summary([r[b] - (r[a] if a else 0.0) for r in runs] if b else [])["median"]
                    return "–" if value is None else f"{value:.2f}"

                rows.append(
                    f"| {setup} | {side} | {span('', 'first_step_s')} | "
                    f"{span('first_step_s', 'last_report_s')} | {span('last_report_s', 'wall_s')} | "
                    f"{span('', 'wall_s')} |"
                )
    return "\n".join(rows + ["", *last_epoch_rows(results)])


def last_epoch_rows(results: dict[str, dict[str, dict[str, list[dict[str, Any]]]]]) -> list[str]:
    """The throughput of the last epoch alone (one ~10 s window a run), the measure used before
    the steady-state median: kept so the two can be compared."""
    rows = [
        "The last epoch's throughput alone (medians, samples/s; one window per run):",
        "",
        "| setup | service | torchrun by hand | ratio of medians |",
        "| --- | ---: | ---: | ---: |",
    ]
    for setup, data in results.items():
        for kind, sides in data.items():
            if not kind.startswith("long"):
                continue
            svc, bare = (
                summary([r.get("last_epoch_samples_per_sec") for r in runs if "error" not in r])["median"]
                for runs in (sides["service"], sides["bare"])
            )
            ratio = f"{svc / bare:.3f}" if svc and bare else "–"
            rows.append(f"| {setup} | {svc or 0:,.0f} | {bare or 0:,.0f} | {ratio} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="embedded, single, one launch, no warm-up")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument(
        "--setups", nargs="+", default=["embedded", "postgres"], choices=["embedded", "postgres"]
    )
    parser.add_argument("--modes", nargs="+", default=["single", "ddp"], choices=["single", "ddp"])
    parser.add_argument("--runs", type=int, default=5, help="launch runs per mode and setup")
    parser.add_argument("--long-modes", nargs="+", default=["ddp"], choices=["single", "ddp"])
    parser.add_argument("--long-runs", type=int, default=10, help="pairs of one-minute runs (noisy: more)")
    parser.add_argument("--synthetic-size", type=int, default=49152, help="of the ~1 minute job")
    parser.add_argument("--epochs", type=int, default=4, help="of the ~1 minute job")
    parser.add_argument("--artifacts", type=Path, default=REPO / "test-artifacts" / "bench" / "launch")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    args = parser.parse_args(argv)
    if args.smoke:
        args.setups, args.modes, args.runs, args.long_runs, args.warmup = (
            ["embedded"],
            ["single"],
            1,
            0,
            False,
        )

    results: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    with workdir("tj-bench-launch-", keep_on_error=args.artifacts) as scratch:
        for setup in args.setups:
            print(f"{setup}: starting the stack", file=sys.stderr, flush=True)
            if setup == "embedded":
                with embedded_stack(scratch / "embedded") as stack:
                    results[setup] = bench_setup("embedded", stack, args, scratch)
            else:
                with production_stack(scratch / "postgres", {"w1": 2}) as (stack, _):
                    results["PostgreSQL + Redis"] = bench_setup("postgres", stack, args, scratch)

    figs = [f for setup, data in results.items() for f in figures_for(setup, data)]
    result: dict[str, Any] = {
        "name": "launch",
        "title": "Launch, whole job and throughput: the service against torchrun by hand",
        "figures": figs,
        "details": details(results),
        "notes": [
            f"launch: one epoch of digits, report_every 1, {args.runs} run(s) per mode and setup; "
            f"whole job: cnn on synthetic ({args.synthetic_size} samples) x {args.epochs} epochs, "
            f"{args.long_runs} run(s)",
            "the product's default settings (a scheduler pass every 1 s while a job waits, every 5 s "
            "otherwise), not the tests' short intervals",
        ],
        "raw": results,
    }
    for setup, data in results.items():
        for kind, sides in data.items():
            for side, runs in sides.items():
                result["notes"].extend(failure_notes(f"{setup} {kind} {side}", runs))
    write_result(args.json, result)
    print_figures(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
