"""What the ranks' sandbox costs (issue #19): POST -> first step and throughput, sandboxed
against the same product with the sandbox off, measured in the same run.

    .venv/bin/python -m bench.sandbox            # ~30 min on an idle machine
    .venv/bin/python -m bench.sandbox --smoke    # one launch each: the code path only

Three embedded stacks (`torchjobs up --gpus 2 --accelerator cpu`) live side by side and take
turns, the order rotating every round so that a shared machine's drift hits all alike:

* **sandbox**: the default (bubblewrap, ranks as another user; the warm agent waits in a spare
  sandbox of its own, moved under the node when the launch comes: sandbox_spares.py);
* **no sandbox**: `TORCHJOBS_SANDBOX=off` (and `TORCHJOBS_ALLOW_UNISOLATED=true`), the warm
  torchrun agent on: what the product did before;
* **no sandbox, cold**: the same with `TORCHJOBS_WARM_AGENT=false`, which splits the cost into
  bubblewrap's own and the warm agent's that the sandbox gives up.

Then the floor of the throughput figure without any service: the same `torchrun` by hand
(bench/launch.py's bare run), alternately as it is and inside bubblewrap exactly as a node's
sandbox builds it (as the sandbox user, the run folder at /job), so that bubblewrap's own
cost is told apart from the noise of three stacks on two cores.

Launch is bench/launch.py's measure (the rank's own timestamp of its first optimizer step,
from the moment before the POST), one epoch of digits; throughput is the steady samples/s of
a DDP x2 job on synthetic data, paired sandbox / no sandbox.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import REPO, bench_env, figure, paired_interval, print_figures, workdir, write_result
from bench.launch import launch_job, long_job, run_bare, run_service
from service.testing import harness
from workers.launcher import sandbox
from workers.launcher.sandbox import ENV_FILE, RUN_DIR, Mounts

SIDES = {
    "sandbox": {},
    "no sandbox": {"TORCHJOBS_SANDBOX": "off", "TORCHJOBS_ALLOW_UNISOLATED": "true"},
    "no sandbox, cold": {
        "TORCHJOBS_SANDBOX": "off",
        "TORCHJOBS_ALLOW_UNISOLATED": "true",
        "TORCHJOBS_WARM_AGENT": "false",
    },
}


@contextlib.contextmanager
def stacks(scratch: Path) -> Iterator[dict[str, harness.Stack]]:
    up: dict[str, harness.Stack] = {}
    try:
        for i, (side, extra) in enumerate(SIDES.items()):
            home = scratch / f"side{i}"
            home.mkdir(parents=True)
            up[side] = harness.embedded_stack(home, bench_env(home, **extra))
        yield up
    finally:
        for stack in up.values():
            stack.stop()


def rounds(up: dict[str, harness.Stack], spec: dict[str, Any], n: int, timeout: float) -> dict[str, list]:
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in up}
    order = list(up)
    for i in range(n):
        turn = order[i % len(order) :] + order[: i % len(order)]
        for side in turn:
            runs[side].append(run_service(up[side], spec, timeout))
        print(f"  {spec['name']} round {i + 1}/{n}", file=sys.stderr, flush=True)
    return runs


def in_sandbox(iso: sandbox.Isolation) -> Any:
    """bench.launch's bare torchrun, moved into a node's sandbox: its folder at /job."""

    def launcher(argv: list[str], env: dict[str, str], where: Path) -> tuple[list[str], dict[str, str]]:
        inside = [a.replace(str(where), str(RUN_DIR)) for a in argv]
        env = {k: v.replace(str(where), str(RUN_DIR)) for k, v in env.items()}
        (where / "tmp").mkdir(exist_ok=True)
        (where / "checkpoints").mkdir(exist_ok=True)
        env_file = where / ENV_FILE
        env_file.write_text(json.dumps({**env, "TMPDIR": "/tmp", "HOME": "/job"}))
        if iso.owner is not None:
            for path in (where, where / "tmp", where / "checkpoints", env_file):
                os.chown(path, *iso.owner)
        read_only = (*sandbox.python_paths(sys.executable), str(REPO / "workers"))
        mounts = Mounts(run_dir=where, tmp_dir=where / "tmp", read_only=read_only)
        return sandbox.wrap(inside, iso, mounts, sys.executable), {"PATH": "/usr/bin:/bin"}

    return launcher


def bare_pairs(spec: dict[str, Any], n: int, scratch: Path) -> dict[str, list]:
    iso = sandbox.detect("auto", "torchjobs-run")
    if not iso.sandboxed:
        raise RuntimeError(f"no sandbox here: {iso.detail}")
    runs: dict[str, list[dict[str, Any]]] = {"bwrap": [], "bare": []}
    for i in range(n):
        for side in ("bwrap", "bare") if i % 2 == 0 else ("bare", "bwrap"):
            launcher = in_sandbox(iso) if side == "bwrap" else None
            runs[side].append(run_bare(spec, scratch / f"bare-{side}-{i}", 900, launcher))
        print(f"  bare torchrun pair {i + 1}/{n}", file=sys.stderr, flush=True)
    return runs


def figures(launch: dict[str, dict[str, list]], long: dict[str, list]) -> list[dict[str, Any]]:
    figs = []
    for mode, runs in launch.items():
        first = {side: [r["first_step_s"] for r in rs] for side, rs in runs.items()}
        later = [s - f for s, f in zip(first["sandbox"], first["no sandbox"], strict=True)]
        figs.append(
            figure(
                f"first step: sandbox later than none by, {mode}",
                "s",
                later,
                setup="embedded",
                target="<= 0.2",
                note="per pair of runs, the same round",
            )
        )
        for floor_side in ("no sandbox", "no sandbox, cold"):
            figs.append(
                figure(
                    f"POST -> first step, {mode}",
                    "s",
                    first["sandbox"],
                    first[floor_side],
                    setup="embedded",
                    floor_name=floor_side,
                )
            )
    throughputs = (  # measure, side, floor side, setup, floor's name
        (
            "throughput, ddp x2, torchrun by hand in bwrap",
            "bwrap",
            "bare",
            "no service",
            "the same, no bwrap",
        ),
        ("throughput, ddp x2", "sandbox", "no sandbox", "embedded", "no sandbox"),
    )
    for measure, side, floor_side, setup, floor_name in throughputs:
        if long.get(side):
            speeds = {k: [r["samples_per_sec"] for r in long[k]] for k in (side, floor_side)}
            figs.append(
                figure(
                    measure,
                    "samples/s",
                    speeds[side],
                    speeds[floor_side],
                    setup=setup,
                    floor_name=floor_name,
                    target=">= 0.99",
                    note=paired_interval(speeds[side], speeds[floor_side]),
                )
            )
    return figs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--runs", type=int, default=6, help="launch rounds per mode")
    parser.add_argument("--long-runs", type=int, default=60, help="rounds of the throughput job (noisy)")
    parser.add_argument("--bare-runs", type=int, default=10, help="pairs of bare torchrun, in bwrap and not")
    parser.add_argument("--synthetic-size", type=int, default=12288)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--artifacts", type=Path, default=REPO / "test-artifacts" / "bench" / "sandbox")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.long_runs, args.bare_runs = 1, 0, 0
    launch: dict[str, dict[str, list]] = {}
    long: dict[str, list] = {}
    job = long_job("ddp", args.synthetic_size, args.epochs)
    with workdir("tj-bench-sandbox-", keep_on_error=args.artifacts) as scratch:
        if args.bare_runs:  # first, alone on the machine: no stack is up yet
            long.update(bare_pairs(job, args.bare_runs, scratch))
        with stacks(scratch) as up:
            for mode in ("single", "ddp"):
                run_service(up["sandbox"], launch_job(mode), 300)  # warm-up, not counted
                launch[mode] = rounds(up, launch_job(mode), args.runs, 300)
            if args.long_runs:
                pair = {k: up[k] for k in ("sandbox", "no sandbox")}
                long.update(rounds(pair, job, args.long_runs, 900))
    result = {
        "name": "sandbox",
        "title": "The ranks' sandbox: launch and throughput against the same product unsandboxed",
        "figures": figures(launch, long),
        "notes": [
            f"embedded stacks side by side, {args.runs} launch round(s) per mode, {args.long_runs} "
            f"throughput round(s) of ddp x2 on synthetic ({args.synthetic_size} x {args.epochs} epochs); "
            f"{args.bare_runs} pair(s) of the same job by hand, in bwrap and not, before any stack starts",
            "sandbox: the warm agent waits in a spare sandbox, moved under the node at launch; "
            "no sandbox, cold: TORCHJOBS_WARM_AGENT=false, which splits bubblewrap's own cost from "
            "the warm agent's",
        ],
        "raw": {"launch": launch, "long": long},
    }
    write_result(args.json, result)
    print_figures(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
