"""A job's `environment.pip` (issue #21): building a fresh one, reusing it, and what a reused
one adds to a launch, each against a floor measured in the same run.

    .venv/bin/python -m bench.environment            # ~3 min
    .venv/bin/python -m bench.environment --smoke    # one round: the code path only

1. Build, on this machine, with the product's own `workers.environments.ensure_environment`
   (uv: compile against the worker's pinned packages, then install what that adds), into an
   empty cache each round, uv's download cache emptied too: a fresh build. The floor: what
   people do today, `python -m venv` and `pip install` of the same set into a fresh venv, pip's
   cache off. Then the same set again with the product's cache warm: a reuse.
2. Launch, through the service (an embedded stack): POST -> the rank's first step of a
   builtin job (bench/launch.py's measure) with a reused `environment.pip`, paired with the
   same job without any environment.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, figure, print_figures, workdir, write_result
from bench.common import embedded_stack as bench_stack
from bench.launch import launch_job, run_service
from service.config import Settings
from workers.environments import ensure_environment

SET = ["tabulate==0.10.0", "einops==0.8.1", "humanize==4.12.3"]


def product_build(home: Path, reuse: bool) -> float:
    settings = Settings(home=home)
    if not reuse:
        shutil.rmtree(settings.cache_dir, ignore_errors=True)
    t0 = time.perf_counter()
    built = ensure_environment(settings, SET, home / "build.log")
    elapsed = time.perf_counter() - t0
    assert built.reused == reuse, (built, reuse)
    return elapsed


def pip_floor(scratch: Path) -> float:
    venv = scratch / "floor-venv"
    shutil.rmtree(venv, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-cache-dir", *SET]
    subprocess.run(pip, check=True)
    return time.perf_counter() - t0


def build_rounds(rounds: int, scratch: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"fresh": [], "reuse": [], "pip": []}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="tj-env-", dir=scratch) as home:
            out["fresh"].append(product_build(Path(home), reuse=False))
            out["reuse"].append(product_build(Path(home), reuse=True))
        out["pip"].append(pip_floor(scratch))
    return out


def launch_rounds(rounds: int, scratch: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"with": [], "without": []}
    plain = launch_job("single")
    with_env = {**plain, "environment": {"pip": SET}}
    with bench_stack(scratch / "stack") as stack:
        run_service(stack, with_env, 300)  # builds it once: not counted
        for i in range(rounds):
            order = (
                (("with", with_env), ("without", plain))
                if i % 2 == 0
                else (("without", plain), ("with", with_env))
            )
            for side, spec in order:
                out[side].append(run_service(stack, spec, 300)["first_step_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--launch-runs", type=int, default=4)
    parser.add_argument("--artifacts", type=Path, default=REPO / "test-artifacts" / "bench" / "environment")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.launch_runs = 1, 1
    with workdir("tj-bench-env-", keep_on_error=args.artifacts) as scratch:
        builds = build_rounds(args.runs, scratch)
        launches = launch_rounds(args.launch_runs, scratch)
    setup = f"{len(SET)} packages ({', '.join(SET)}), from the registry"
    result: dict[str, Any] = {
        "name": "environment",
        "title": "environment.pip: fresh build, reuse, and the launch of a job that reuses one",
        "figures": [
            figure(
                "fresh environment (empty caches)",
                "s",
                builds["fresh"],
                builds["pip"],
                setup=setup,
                floor_name="python -m venv + pip install, no cache",
            ),
            figure(
                "reused environment",
                "s",
                builds["reuse"],
                builds["pip"],
                setup=setup,
                floor_name="python -m venv + pip install, no cache",
            ),
            figure(
                "POST -> first step, environment reused",
                "s",
                launches["with"],
                launches["without"],
                setup="embedded stack, builtin digits, single",
                floor_name="the same job without environment",
                target="within 1 s of the job without",
            ),
        ],
        "notes": [f"{args.runs} build round(s), {args.launch_runs} launch pair(s), order alternating"],
        "raw": {"builds": builds, "launches": launches},
    }
    write_result(args.json, result)
    print_figures(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
