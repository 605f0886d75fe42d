"""ASHA early stopping (contract §13): a sweep's summed GPU-seconds with `early_stop`, against
the same grid run to its end (issue #40).

    .venv/bin/python -m bench.asha            # 2 runs of each, 9 children of 6 epochs of 65,536; ~10 min
    .venv/bin/python -m bench.asha --samples 8192   # epochs of 8,192: the launch outweighs them
    .venv/bin/python -m bench.asha --smoke    # 1 run of each, 9 children of 2 epochs of 8,192

On `torchjobs db upgrade` + `server` + `worker --accelerator cpu --gpus 2`, PostgreSQL and Redis,
the product's default settings. The grid: the builtin mlp on synthetic data (`--samples` an
epoch), `lr` in {0.02, 1e-6, 1e-7} (one that learns and two that learn nothing in an epoch) x
`seed` in {0, 1, 2},
`max_parallel` 2. The service: `early_stop: {"kind": "asha", "min_epochs": 1,
"reduction_factor": 3}` with `objective: val_loss, min`. The floor: the same sweep without
`early_stop`. Measured: the children's summed `gpu_seconds` (every attempt, start to end, as
usage counts it), the epochs they completed, and the sweep's wall time (POST to the parent's
end). The two sweeps alternate, the one going first swapping every run; both must pick the
same best point.

Nothing is asserted on the times.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench.common import (
    REPO,
    failure_notes,
    figure,
    print_figures,
    production_stack,
    workdir,
    write_result,
)
from service.testing import harness

LRS = [0.02, 1e-6, 1e-7]
SEEDS = [0, 1, 2]
ASHA = {"kind": "asha", "min_epochs": 1, "reduction_factor": 3}


def sweep_spec(epochs: int, early_stop: bool, samples: int) -> dict[str, Any]:
    sweep: dict[str, Any] = {
        "grid": {"hyperparameters.lr": LRS, "hyperparameters.seed": SEEDS},
        "max_parallel": 2,
        "objective": {"metric": "val_loss", "mode": "min"},
    }
    if early_stop:
        sweep["early_stop"] = ASHA
    return {
        "name": "asha" if early_stop else "grid",
        "mode": "single",
        "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "synthetic"},
        "hyperparameters": {
            "epochs": epochs,
            "batch_size": 16,
            "synthetic_size": samples,
            "num_workers": 0,
            "optimizer": "adamw",
            "lr": 0.01,
        },
        "sweep": sweep,
    }


def run_sweep(
    stack: harness.Stack, epochs: int, early_stop: bool, samples: int, timeout: float
) -> dict[str, Any]:
    started = time.monotonic()
    parent = stack.submit(sweep_spec(epochs, early_stop, samples))
    done = stack.wait_job(parent["id"], timeout=timeout, interval=1.0)
    wall = time.monotonic() - started
    if done["state"] != "succeeded":
        raise RuntimeError(f"sweep {parent['id']} ended {done['state']}: {stack.describe(parent['id'])}")
    with stack.client() as c:
        kids = c.get("/v1/jobs", params={"parent": parent["id"], "limit": 100}).json()["items"]
        completed = 0
        for kid in kids:
            series = c.get(f"/v1/jobs/{kid['id']}/metrics", params={"names": "val_loss"}).json()["series"]
            completed += max((p["epoch"] or 0 for p in series), default=0)
        best = c.get(f"/v1/jobs/{parent['id']}").json()["sweep"]["best"]
    return {
        "gpu_seconds": sum(k["gpu_seconds"] for k in kids),
        "epochs": completed,
        "stopped": sum(1 for k in kids if k["stopped_early"]),
        "wall_s": wall,
        "best": best["point"] if best else None,
    }


def measure(runs: int, epochs: int, samples: int) -> dict[str, list[dict[str, Any]]]:
    sides: dict[str, list[dict[str, Any]]] = {"asha": [], "grid": []}
    timeout = 60 + 9 * (20 + 15 * epochs * max(1, samples // 8192))
    with (
        workdir("tj-bench-asha-", keep_on_error=REPO / "test-artifacts" / "bench" / "asha") as scratch,
        production_stack(scratch / "stack", {"w1": 2}) as (stack, _),
    ):
        for i in range(runs):
            order = ["asha", "grid"] if i % 2 == 0 else ["grid", "asha"]
            for side in order:
                try:
                    got = run_sweep(stack, epochs, side == "asha", samples, timeout)
                except Exception as exc:  # a figure from fewer runs says so
                    got = {"error": str(exc)}
                sides[side].append(got)
                print(f"  run {i + 1} {side}: {got}", file=sys.stderr, flush=True)
    return sides


def make_result(sides: dict[str, list[dict[str, Any]]], epochs: int, samples: int) -> dict[str, Any]:
    pairs = [
        (a, g)
        for a, g in zip(sides["asha"], sides["grid"], strict=True)
        if "error" not in a and "error" not in g
    ]
    setup = f"9 children x {epochs} epochs of {samples:,}, 2 slots"
    figs = [
        figure(
            "sweep GPU-seconds with ASHA",
            "s",
            [a["gpu_seconds"] for a, _ in pairs],
            [g["gpu_seconds"] for _, g in pairs],
            setup=setup,
            floor_name="the same grid without early_stop",
            target="well under 0.7",
        ),
        figure(
            "sweep wall time with ASHA (POST to the parent's end)",
            "s",
            [a["wall_s"] for a, _ in pairs],
            [g["wall_s"] for _, g in pairs],
            setup=setup,
            floor_name="the same grid without early_stop",
        ),
        figure(
            "epochs completed with ASHA",
            "epochs",
            [a["epochs"] for a, _ in pairs],
            [g["epochs"] for _, g in pairs],
            setup=setup,
            floor_name="the same grid without early_stop",
        ),
    ]
    notes = failure_notes("asha", sides["asha"]) + failure_notes("grid", sides["grid"])
    for i, (a, g) in enumerate(pairs):
        notes.append(
            f"run {i + 1}: ASHA stopped {a['stopped']} of 9, best {a['best']}; "
            f"the full grid's best {g['best']}"
        )
    return {
        "name": "asha",
        "title": "A sweep with ASHA early stopping against the same grid run to its end",
        "figures": figs,
        "notes": notes,
        "raw": sides,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=65536, help="synthetic samples an epoch")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.epochs, args.samples = 1, 2, 8192
    sides = measure(args.runs, args.epochs, args.samples)
    result = make_result(sides, args.epochs, args.samples)
    write_result(args.json, result)
    print_figures(result)
    return 1 if any("error" in r for side in sides.values() for r in side) else 0


if __name__ == "__main__":
    raise SystemExit(main())
