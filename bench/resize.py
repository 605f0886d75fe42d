"""Preemption and a lost node (contract §12): how soon the job that should run trains, against a
fresh submit of the same job on free GPUs (issue #39).

    .venv/bin/python -m bench.resize            # 3 runs of each; ~10 min
    .venv/bin/python -m bench.resize --smoke    # 1 run of each

On `torchjobs db upgrade` + `server` + `worker --accelerator cpu --gpus 1` per worker, PostgreSQL
and Redis, the product's default settings (TEST_ONLY_SETTINGS in bench/common.py are not set:
heartbeats every 5 s, a worker lost after 15 s without one, a scheduler pass every 1 s while a
job waits and every 5 s otherwise). Every job reports after every step (`report_every: 1`); its
first step is the rank's own clock of its first progress report (`data.reported_at`), as in
bench/launch.py; every other instant is an event's storing time (`ts`), on the same machine.

1. Preemption, two one-slot workers. The service: a `ddp` job of 2 nodes at priority 0 (long;
   it checkpoints only when asked to stop; `stop_grace_s` 30) fills both slots and trains; then
   a `single` job at priority 5 (the admin's) is submitted. Measured: from before that POST to
   its first step, less the grace the victim actually used: from the victim's `preempted` event
   to its `state` event `queued` (its last node ended and its slots were freed, in that
   transaction). The floor: the same priority-5 job submitted on the free cluster, POST to its
   first step. Every job is cancelled between runs; service and floor alternate, the one going
   first swapping every run.
2. A lost node, three one-slot workers. The service: an elastic `ddp` job, `nodes: {min: 2,
   max: 3}` (tests/integration/test_elastic.py's spec, builtin mlp on synthetic, num_workers 0,
   a checkpoint every epoch), on all three; after its first `checkpoint` event the worker of its
   highest node rank is SIGKILLed with its ranks. Measured: from before the kill to the first
   step of the next attempt (the first progress report stored after the `resize` event
   `{"from": 3, "to": 2, "reason": "node lost"}`), resuming from its checkpoint on the two left.
   The host is quarantined after the third loss in a row there (contract §8) and readmitted
   between runs. The heartbeat timeout (15 s, the product's default) is part of that figure: the details split
   it into kill -> the job's `queued` (the loss noticed, the survivors stopped), -> `resize` (the
   event of its placement on the two left) and -> the first step (the restart). The
   floor: the same spec with `nodes: 2` submitted on free workers, POST to its first step. The
   job is cancelled and the killed worker started again between runs.

Nothing is asserted on the times.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
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

ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "synthetic"}
TERMINAL = ("succeeded", "failed", "cancelled")


def victim_spec() -> dict[str, Any]:
    """The low-priority job filling the cluster: long, a checkpoint only when asked to stop."""
    return {
        "name": "bench-preempt-victim",
        "mode": "ddp",
        "nodes": 2,
        "gpus_per_node": 1,
        "priority": 0,
        "entrypoint": ENTRY,
        "hyperparameters": {
            "epochs": 10_000,
            "synthetic_size": 512,
            "batch_size": 64,
            "num_workers": 0,
            "checkpoint_every": 10_000,
        },
        "stop_grace_s": 30,
    }


def high_spec() -> dict[str, Any]:
    """The priority-5 job: one slot, a report after every step (cancelled after its first)."""
    return {
        "name": "bench-preempt-high",
        "mode": "single",
        "gpus_per_node": 1,
        "priority": 5,
        "entrypoint": ENTRY,
        "hyperparameters": {
            "epochs": 10_000,
            "synthetic_size": 512,
            "batch_size": 64,
            "num_workers": 0,
            "checkpoint_every": 10_000,
            "report_every": 1,
        },
        "stop_grace_s": 30,
    }


def elastic_spec(nodes: int | dict[str, int]) -> dict[str, Any]:
    """tests/integration/test_elastic.py's job, long, a report after every step."""
    return {
        "name": "bench-elastic" if isinstance(nodes, dict) else "bench-elastic-fixed",
        "mode": "ddp",
        "nodes": nodes,
        "gpus_per_node": 1,
        "entrypoint": ENTRY,
        "hyperparameters": {
            "epochs": 10_000,
            "synthetic_size": 384,
            "batch_size": 32,
            "global_batch_size": 96,
            "num_workers": 0,
            "checkpoint_every": 1,
            "report_every": 1,
        },
        "keep_checkpoints": 2,
        "max_retries": 0,
        "stop_grace_s": 30,
    }


# ------------------------------------------------------------------------------------------ events


class Events:
    """A job's events as they come, fetched after the last seq seen (a long job's thousands of
    progress reports are not read again at every poll)."""

    def __init__(self, stack: harness.Stack, job_id: int) -> None:
        self.stack, self.job_id = stack, job_id
        self.items: list[dict[str, Any]] = []

    def fetch(self) -> list[dict[str, Any]]:
        with self.stack.client() as c:
            while True:
                after = self.items[-1]["seq"] if self.items else 0
                page = c.get(f"/v1/jobs/{self.job_id}/events", params={"after": after}).json()["items"]
                if not page:
                    return self.items
                self.items.extend(page)

    def wait(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str, after: int = 0
    ) -> dict[str, Any]:
        def seen() -> dict[str, Any] | None:
            return next((e for e in self.fetch() if e["seq"] > after and predicate(e)), None)

        try:
            found: dict[str, Any] = harness.wait_for(seen, timeout, f"{what} (job {self.job_id})", 0.3)
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{self.stack.describe(self.job_id)[-3000:]}") from None
        return found


def is_step(e: dict[str, Any]) -> bool:
    return e["type"] == "progress" and isinstance(e["data"].get("step"), int) and e["data"]["step"] >= 1


def step_time(e: dict[str, Any]) -> float:
    """A progress event's rank clock, else (an ingestion that dropped it) its storing time."""
    reported = e["data"].get("reported_at")
    return float(reported) if reported is not None else parse_ts(e["ts"])


def state_at(events: list[dict[str, Any]], state: str, after: int = 0) -> float | None:
    return next(
        (
            parse_ts(e["ts"])
            for e in events
            if e["seq"] > after and e["type"] == "state" and e["data"].get("state") == state
        ),
        None,
    )


def post(stack: harness.Stack, spec: dict[str, Any]) -> tuple[float, int]:
    """(the time just before the POST, the job's id)."""
    with stack.client() as c:
        t0 = time.time()
        resp = c.post("/v1/jobs", json=spec)
    if resp.status_code != 201:
        raise RuntimeError(f"POST /v1/jobs: {resp.status_code} {resp.text}")
    return t0, int(resp.json()["id"])


def cancel(stack: harness.Stack, *job_ids: int) -> None:
    """Cancel and wait until each has ended (its slots free for the next run)."""
    with stack.client() as c:
        for job_id in job_ids:
            c.post(f"/v1/jobs/{job_id}/cancel")
    for job_id in job_ids:
        stack.wait_job(job_id, timeout=120, states=TERMINAL, interval=1.0)


def fresh_first_step(stack: harness.Stack, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The floor: POST on free GPUs -> first step; the job cancelled afterwards."""
    t0, job_id = post(stack, spec)
    try:
        events = Events(stack, job_id)
        first = events.wait(is_step, timeout, "its first step")
        scheduled = state_at(events.items, "scheduled")
        return {
            "first_step_s": step_time(first) - t0,
            "to_scheduled_s": None if scheduled is None else scheduled - t0,
        }
    finally:
        cancel(stack, job_id)


# ------------------------------------------------------------------------------------------ 1. preemption


def preemption_service(stack: harness.Stack, timeout: float) -> dict[str, Any]:
    """The victim fills both slots and trains; the priority-5 job's POST -> its first step."""
    _, low = post(stack, victim_spec())
    high = None
    try:
        low_events = Events(stack, low)
        low_events.wait(is_step, timeout, "the victim's first step")
        t0, high = post(stack, high_spec())
        high_events = Events(stack, high)
        first = high_events.wait(is_step, timeout, "the preemptor's first step")
        preempted = low_events.wait(lambda e: e["type"] == "preempted", 30, "the preempted event")
        low_events.wait(
            lambda e: e["type"] == "state" and e["data"].get("state") == "queued",
            60,
            "the victim queued again",
            after=preempted["seq"],
        )
        t_preempted = parse_ts(preempted["ts"])
        t_ended = state_at(low_events.items, "queued", after=preempted["seq"])
        assert t_ended is not None
        t_first = step_time(first)
        scheduled = state_at(high_events.items, "scheduled")
        grace = t_ended - t_preempted
        return {
            "first_step_s": t_first - t0 - grace,
            "raw_first_step_s": t_first - t0,
            "to_preempted_s": t_preempted - t0,
            "grace_used_s": grace,
            "freed_to_scheduled_s": None if scheduled is None else scheduled - t_ended,
            "scheduled_to_step_s": None if scheduled is None else t_first - scheduled,
        }
    finally:
        cancel(stack, *(j for j in (high, low) if j is not None))


# ------------------------------------------------------------------------------------------ 2. lost node


def running_on(stack: harness.Stack, job_id: int) -> list[dict[str, Any]]:
    with stack.client() as c:
        job = c.get(f"/v1/jobs/{job_id}").json()
    return list(job["assignments"]) if job["state"] == "running" else []


def lost_node_service(stack: harness.Stack, timeout: float) -> dict[str, Any]:
    """The elastic job on three workers; one SIGKILLed after the first checkpoint -> the first
    step of the attempt on the two left. The killed worker is started again afterwards."""
    _, job_id = post(stack, elastic_spec({"min": 2, "max": 3}))
    killed = None
    try:
        harness.wait_for(lambda: len(running_on(stack, job_id)) == 3, timeout, "the job on three nodes")
        events = Events(stack, job_id)
        events.wait(lambda e: e["type"] == "checkpoint", timeout, "its first checkpoint")
        last = max(running_on(stack, job_id), key=lambda a: a["node_rank"])
        killed = last["worker"]
        before = events.fetch()[-1]["seq"]
        t_kill = time.time()
        stack.kill(f"worker-{killed}")
        resize = events.wait(
            lambda e: e["type"] == "resize" and e["data"].get("reason") == "node lost", 120, "the resize"
        )
        if (resize["data"].get("from"), resize["data"].get("to")) != (3, 2):
            raise RuntimeError(f"resize {resize['data']}, not 3 -> 2")
        first = events.wait(is_step, timeout, "the first step on the two left", after=resize["seq"])
        t_resize, t_first = parse_ts(resize["ts"]), step_time(first)
        queued = state_at(events.items, "queued", after=before)
        return {
            "first_step_s": t_first - t_kill,
            "to_queued_s": None if queued is None else queued - t_kill,
            "queued_to_resize_s": None if queued is None else t_resize - queued,
            "resize_to_step_s": t_first - t_resize,
            "killed": f"{killed} (node rank {last['node_rank']})",
        }
    finally:
        cancel(stack, job_id)
        if killed is not None:
            restart(stack, killed)


def restart(stack: harness.Stack, name: str) -> None:
    """The killed worker started again. Its host is `quarantined` after the third lost node in a
    row there (contract §8, TORCHJOBS_QUARANTINE_AFTER 3): it is readmitted, as an admin would."""

    def readmit_if_quarantined() -> bool:
        if (stack.worker(name) or {}).get("state") != "quarantined":
            return False
        with stack.client() as c:
            c.post(f"/v1/workers/{name}/readmit")
        return True

    readmit_if_quarantined()
    try:
        stack.start_worker(name, 1)
    except TimeoutError:
        if not readmit_if_quarantined():
            raise RuntimeError(f"worker {name} not back online: {stack.worker(name)}") from None
        stack.wait_worker_online(name)


# ------------------------------------------------------------------------------------------ the driver

Run = Callable[[], dict[str, Any]]


def alternate(name: str, runs: int, service: Run, floor: Run) -> dict[str, list[dict[str, Any]]]:
    """{"service": [...], "floor": [...]}, the one going first swapping every run; a failed run
    is recorded (its error) and the others go on."""
    out: dict[str, list[dict[str, Any]]] = {"service": [], "floor": []}
    for i in range(runs):
        sides = [("service", service), ("floor", floor)]
        for side, fn in sides if i % 2 == 0 else sides[::-1]:
            try:
                result = fn()
            except Exception as exc:
                result = {"error": str(exc)[-1500:]}
            out[side].append(result)
        print(f"  {name} run {i + 1}: " + describe(out, -1), file=sys.stderr, flush=True)
    return out


def describe(sides: dict[str, list[dict[str, Any]]], i: int) -> str:
    parts = []
    for side, runs in sides.items():
        r = runs[i]
        if "error" in r:
            parts.append(f"{side}: FAILED {r['error'][-300:]}")
        else:
            figures = (f"{k} {v:.2f}" for k, v in r.items() if isinstance(v, float))
            parts.append(f"{side}: " + ", ".join(figures))
    return "; ".join(parts)


Runs = list[dict[str, Any]]


def ok_pairs(sides: dict[str, Runs]) -> tuple[Runs, Runs, int]:
    """The service's and the floor's runs where neither side failed, and how many did."""
    pairs = [(a, b) for a, b in zip(sides["service"], sides["floor"], strict=True) if "error" not in {*a, *b}]
    return [a for a, _ in pairs], [b for _, b in pairs], len(sides["service"]) - len(pairs)


def med(runs: list[dict[str, Any]], key: str) -> str:
    value = summary([r.get(key) for r in runs])["median"]
    return "–" if value is None else f"{value:.2f}"


def details(preempt: dict[str, list[dict[str, Any]]], lost: dict[str, list[dict[str, Any]]]) -> str:
    p_svc, p_floor, _ = ok_pairs(preempt)
    l_svc, l_floor, _ = ok_pairs(lost)
    return "\n".join(
        [
            "Where the time goes (medians, seconds; instants are events' storing times, the first "
            "step the rank's clock):",
            "",
            "| figure | -> victim `preempted` | grace used (excluded) | freed -> `scheduled` | "
            "`scheduled` -> first step | submit -> first step, grace included | floor: -> `scheduled` |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| preemption | {med(p_svc, 'to_preempted_s')} | {med(p_svc, 'grace_used_s')} | "
            f"{med(p_svc, 'freed_to_scheduled_s')} | {med(p_svc, 'scheduled_to_step_s')} | "
            f"{med(p_svc, 'raw_first_step_s')} | {med(p_floor, 'to_scheduled_s')} |",
            "",
            "| figure | kill -> `queued` (loss noticed, the survivors stopped) | `queued` -> `resize` "
            "(placed on 2) | `resize` -> first step | floor: -> `scheduled` |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| lost node | {med(l_svc, 'to_queued_s')} | {med(l_svc, 'queued_to_resize_s')} | "
            f"{med(l_svc, 'resize_to_step_s')} | {med(l_floor, 'to_scheduled_s')} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one run of each")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--runs", type=int, default=3, help="runs of each figure, service and floor")
    parser.add_argument("--timeout", type=float, default=180, help="seconds for each wait")
    parser.add_argument("--artifacts", type=Path, default=REPO / "test-artifacts" / "bench" / "resize")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs = 1

    with workdir("tj-bench-resize-", keep_on_error=args.artifacts) as scratch:
        print("preemption: starting the stack (2 one-slot workers)", file=sys.stderr, flush=True)
        with production_stack(scratch / "preempt", {"p1": 1, "p2": 1}) as (stack, _):
            preempt = alternate(
                "preemption",
                args.runs,
                lambda: preemption_service(stack, args.timeout),
                lambda: fresh_first_step(stack, high_spec(), args.timeout),
            )
        print("lost node: starting the stack (3 one-slot workers)", file=sys.stderr, flush=True)
        with production_stack(scratch / "lost", {"e1": 1, "e2": 1, "e3": 1}) as (stack, _):
            lost = alternate(
                "lost node",
                args.runs,
                lambda: lost_node_service(stack, args.timeout),
                lambda: fresh_first_step(stack, elastic_spec(2), args.timeout),
            )

    figs = []
    for sides, measure, setup, floor_name, note in (
        (
            preempt,
            "preemption: higher-priority POST -> first step, grace excluded",
            "2 workers x 1 slot",
            "the same job POSTed on free GPUs",
            "the victim: ddp on 2 nodes at priority 0, stop_grace_s 30; the grace it used (its "
            "`preempted` event -> its `queued`) is subtracted",
        ),
        (
            lost,
            "lost node: kill -> first step on the 2 left",
            "elastic 2-3, 3 workers x 1 slot",
            "nodes: 2 POSTed on free workers",
            "includes the heartbeat timeout (15 s, the default) before the loss is noticed; "
            "resumes from its checkpoint",
        ),
    ):
        svc, floor, failed = ok_pairs(sides)
        if not svc:
            continue
        dropped = f"{failed} run pair(s) left out: a side failed (see the notes)" if failed else ""
        figs.append(
            figure(
                measure,
                "s",
                [r["first_step_s"] for r in svc],
                [r["first_step_s"] for r in floor],
                setup=f"PostgreSQL + Redis, {setup}",
                floor_name=floor_name,
                note="; ".join(x for x in (note, dropped) if x),
            )
        )
    result: dict[str, Any] = {
        "name": "resize",
        "title": "Preemption and a lost node: the job that should run, against a fresh submit on free GPUs",
        "figures": figs,
        "details": details(preempt, lost),
        "notes": [
            f"{args.runs} run(s) of each, service and floor alternating; builtin mlp on synthetic, "
            "report_every 1; the first step is the rank's clock of its first progress report",
            "preemption, grace excluded: the POST of the priority-5 job -> its first step, less "
            "the time from the victim's `preempted` event to its `state` event `queued` (its last "
            "node ended, its slots freed); the supervisors' look at the stop request falls inside "
            "that excluded window",
            "lost node: the product's default heartbeats (every 5 s, a worker lost after 15 s "
            "without one, the reaper in the scheduler's pass): the heartbeat timeout is part of "
            "the figure; the details split it: kill -> the job's `queued` (the loss noticed and the "
            "survivors stopped), -> `resize` (its placement on the two left), -> first step",
            "lost node: the worker of the job's highest node rank is killed each run; its host is "
            "quarantined after the third loss in a row there (contract §8) and readmitted (admin) "
            "before the next run",
        ],
        "raw": {"preemption": preempt, "lost_node": lost},
    }
    for figure_name, sides in (("preemption", preempt), ("lost node", lost)):
        for side, runs in sides.items():
            result["notes"].extend(failure_notes(f"{figure_name} {side}", runs))
    write_result(args.json, result)
    print_figures(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
