"""Warm ranks (issue #42): POST -> first step with the ranks forked from a spare's rank server,
against the same launch cold, and against bare torchrun; and a sweep of short trials.

    .venv/bin/python -m bench.warm_launch            # ~10 min
    .venv/bin/python -m bench.warm_launch --smoke    # single, one run per side, no sweep

Three embedded stacks (`torchjobs up --gpus 2 --accelerator cpu`), one after another, the
product's default settings but for the one named:
* `warm ranks`: the default. Before each POST the benchmark waits until a spare sandbox's rank
  server listens (harness.warm_ranks_ready): what is measured is a launch that finds one;
* `warm agent only`: TORCHJOBS_WARM_RANKS=false (the release before this one): a waiting
  torchrun agent, ranks that import torch themselves; the same wait, for the agent;
* `cold`: TORCHJOBS_WARM_AGENT=false: nothing prepared.
The floor, in the same run, alternating with the service's launch: bare torchrun of the same
trainer and config (bench/launch.py `run_bare`). POST -> first step is measured as in
bench/launch.py: up to the rank's own timestamp of its first step (`report_every: 1`), one
epoch of digits, `single` and `ddp` on 2 processes.

The sweep: 20 children (lr x seed) of 2 epochs of digits, `single`, `max_parallel` 2, on the
`warm ranks` stack and on the `cold` one: POST to the parent's end, against the same 20
trials run one after another by bare torchrun. A CPU worker prepares its next spare only
while no node of its runs (agents.py), so in a sweep that keeps both slots busy most children
start cold: the figure says how much that leaves.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, bench_env, figure, print_figures, workdir, write_result
from bench.launch import launch_job, run_bare, run_service
from service.testing import harness

SIDES = {
    "warm ranks": {},
    "warm agent only": {"TORCHJOBS_WARM_RANKS": "false"},
    "cold": {"TORCHJOBS_WARM_AGENT": "false"},
}
SWEEP_NOTE = (
    "the sweep: a CPU worker prepares its next spare only while none of its nodes runs (its "
    "cores are the ranks' slots) and a spare serves one node, so with both slots kept busy the "
    "children start mostly cold and the sweep takes as long warm as cold (GPU workers keep no "
    "spare sandbox at all: their ranks start cold)"
)
AGENT_SETTLE_S = 10.0  # a waiting agent's import of torch, where no file says it is done


def wait_prepared(stack: harness.Stack, side: str) -> None:
    if side == "warm ranks":
        harness.wait_warm_ranks(stack, timeout=120)
    elif side == "warm agent only":
        time.sleep(AGENT_SETTLE_S)


def launches(
    stack: harness.Stack, side: str, modes: list[str], runs: int, scratch: Path
) -> dict[str, dict[str, list[float]]]:
    """{mode: {"service": [...], "bare": [...]}}: first-step seconds, paired runs."""
    out: dict[str, dict[str, list[float]]] = {}
    run_service(stack, launch_job("single"), 300)  # not counted: the worker's first job
    for i in range(runs):
        for mode in modes:
            spec = launch_job(mode)
            wait_prepared(stack, side)
            service = run_service(stack, spec, 300)["first_step_s"]
            bare = run_bare(spec, scratch / f"{side}-{mode}-{i}".replace(" ", "-"), 300)["first_step_s"]
            pair = out.setdefault(mode, {"service": [], "bare": []})
            pair["service"].append(service)
            pair["bare"].append(bare)
            line = f"  {side} {mode} run {i + 1}: {service:.2f} s, bare {bare:.2f} s"
            print(line, file=sys.stderr, flush=True)
    return out


SWEEP_LRS = [0.001, 0.002, 0.003, 0.004, 0.005]
SWEEP_SEEDS = [0, 1, 2, 3]


def sweep_spec() -> dict[str, Any]:
    spec = launch_job("single")
    spec["hyperparameters"] = {**spec["hyperparameters"], "epochs": 2, "report_every": 10}
    spec["name"] = "bench-warm-sweep"
    grid = {"hyperparameters.lr": SWEEP_LRS, "hyperparameters.seed": SWEEP_SEEDS}
    spec["sweep"] = {"grid": grid, "max_parallel": 2}
    return spec


def run_sweep(stack: harness.Stack, side: str) -> float:
    wait_prepared(stack, side)
    started = time.monotonic()
    parent = stack.submit(sweep_spec())
    done = stack.wait_job(parent["id"], timeout=1800, interval=1.0)
    if done["state"] != "succeeded":
        raise RuntimeError(f"sweep {parent['id']} ended {done['state']}: {stack.describe(parent['id'])}")
    return time.monotonic() - started


def bare_trials(scratch: Path) -> float:
    """The sweep's 20 trials, one after another, by bare torchrun."""
    base = sweep_spec()
    started = time.monotonic()
    for lr in SWEEP_LRS:
        for seed in SWEEP_SEEDS:
            spec = {**base, "hyperparameters": {**base["hyperparameters"], "lr": lr, "seed": seed}}
            run_bare(spec, scratch / f"sweep-bare-{lr}-{seed}", 300)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    modes = ["single"] if args.smoke else ["single", "ddp"]
    runs = 1 if args.smoke else args.runs
    figs: list[dict[str, Any]] = []
    sweeps: dict[str, float] = {}
    with workdir("tj-bench-warm-", keep_on_error=REPO / "test-artifacts" / "bench" / "warm") as scratch:
        for side, settings in SIDES.items():
            home = scratch / side.replace(" ", "-")
            home.mkdir()
            print(f"{side}: starting the stack", file=sys.stderr, flush=True)
            stack = harness.embedded_stack(home, bench_env(home, **settings))
            try:
                for mode, pair in launches(stack, side, modes, runs, scratch).items():
                    label = "ddp x2" if mode == "ddp" else mode
                    target = "<= 0.25" if side == "warm ranks" else ""
                    figs.append(
                        figure(
                            f"POST -> first step, {label}, {side}",
                            "s",
                            pair["service"],
                            pair["bare"],
                            setup="embedded, 1 epoch of digits",
                            floor_name="bare torchrun, same trainer and config",
                            target=target,
                        )
                    )
                if not args.smoke and side in ("warm ranks", "cold"):
                    sweeps[side] = run_sweep(stack, side)
            finally:
                stack.stop()
        bare = bare_trials(scratch) if sweeps else None
    for side, wall in sweeps.items():
        figs.append(
            figure(
                f"20-trial sweep, POST -> parent's end, {side}",
                "s",
                [wall],
                [bare] if bare else None,
                setup="20 children x 2 epochs of digits, single, max_parallel 2, 2 slots",
                floor_name="the 20 trials one after another, bare torchrun",
            )
        )
    result = {
        "name": "warm_launch",
        "title": "Warm ranks: POST -> first step forked from a rank server, against cold and bare torchrun",
        "figures": figs,
        "notes": [
            f"{runs} run(s) per mode and side, service and bare alternating; the warm sides wait "
            f"for their spare before each POST (rank server listening; the agent: {AGENT_SETTLE_S:g} s)",
            SWEEP_NOTE,
        ],
    }
    print_figures(result)
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
