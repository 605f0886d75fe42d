"""The training stall per checkpoint of the builtin trainer in `mode: fsdp` (contract §11): its
asynchronous DCP save against a synchronous `dcp.save` of the same loop, and both against the
same training with no checkpoint.

    .venv/bin/python -m bench.fsdp_checkpoint [--runs 3] [--json PATH] [--smoke]

Each run starts the real trainer three times under torchrun (2 CPU ranks, gloo), in turn:
`none` (no checkpoint while training), `async` (the product: a DCP folder every
`--every-s` seconds, `checkpoint_every_s`) and `sync` (the same, with
TORCHJOBS_FSDP_BLOCKING_SAVE=1: each save returns once its folder is written). The model is a
wide MLP (a factory, bench/fsdp_factories.py), so that a checkpoint is tens of MB.

Two measures of the stall. *Held*: how long the training thread is inside each mid-epoch save
(waiting for the previous one, staging or writing the shards), as rank 0 logs it; the median
per launch. *Excess*, which also counts what the async writer takes from the steps running
beside it: the trainer reports every step (`report_every: 1`), and each report times the step and a save
made right after it (its `samples_per_sec` over one step). A launch's excess is its summed step
time over its step count times its median step: what saves add (the save itself, and for the
async save the steps slowed while the write runs beside them), measured against the same
launch's own pace, so that a machine whose load changes between launches moves it little.
The stall per checkpoint is (excess - the excess of the launch without checkpoints) / the
checkpoints written while training. The figures: async stall against sync stall, and each
variant's training time (the trainer's own epoch timing) against the time with no checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import REPO, figure, print_figures, summary, workdir, write_result
from service.testing.harness import free_port

VARIANTS = ("none", "async", "sync")
SAMPLES_PER_STEP = 32 * 2  # batch 32 per rank, 2 ranks
# rank 0's line for each mid-epoch save (workers/runtime/trainer/loop.py, _save_folder)
HELD = re.compile(r"\[torchjobs rank 0\] checkpoint \S+-step-\d+ \([^)]*training held ([\d.]+) s\)")


def trainer_config(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    return {
        "mode": "fsdp",
        "accelerator": "cpu",
        "gpus_per_node": 2,
        "entrypoint": {
            "kind": "factory",
            "model": "bench.fsdp_factories:wide_mlp",
            "dataset": "bench.fsdp_factories:synthetic",
        },
        "hyperparameters": {
            "epochs": args.epochs,
            "batch_size": 32,
            "lr": 0.001,
            "seed": 0,
            "num_workers": 0,
            "report_every": 1,
            "checkpoint_every": 10_000,  # no epoch-end saves: only the timed mid-epoch ones
            "checkpoint_every_s": None if variant == "none" else args.every_s,
        },
    }


def run_trainer(where: Path, args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """One launch; its training seconds and the checkpoints it wrote while training."""
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps(trainer_config(args, variant)))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHJOBS_", "TORCHELASTIC_", "MASTER_"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        TORCHJOBS_JOB_ID="1",
        TORCHJOBS_CHECKPOINT_DIR=str(where / "checkpoints"),
        TORCHJOBS_EVENTS=str(where / "events.jsonl"),
        BENCH_FSDP_WIDTH=str(args.width),
        BENCH_FSDP_DEPTH=str(args.depth),
        BENCH_FSDP_SAMPLES=str(args.samples),
    )
    if variant == "sync":
        env["TORCHJOBS_FSDP_BLOCKING_SAVE"] = "1"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "workers.runtime.trainer.train",
        "--config",
        str(where / "config.json"),
    ]
    proc = subprocess.run(
        argv, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    held = [float(s) for s in HELD.findall(proc.stdout)]
    return {**measure(where / "events.jsonl"), "held": statistics.median(held) if held else None}


def measure(events_path: Path) -> dict[str, Any]:
    """Training seconds (summed over epochs, from the trainer's own epoch timing), the excess of
    the step times over the launch's median step, and the checkpoints written inside epochs
    (the final, untimed save excluded)."""
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    progress = [e for e in events if e.get("type") == "progress"]
    epochs = [e for e in progress if "val_loss" in e]
    per_epoch = epochs[0]["total_steps"] // epochs[0]["epochs"]
    seconds = sum(per_epoch * SAMPLES_PER_STEP / e["samples_per_sec"] for e in epochs)
    steps = [SAMPLES_PER_STEP / e["samples_per_sec"] for e in progress if "val_loss" not in e]
    excess = sum(steps) - len(steps) * statistics.median(steps)
    saved = [e for e in events if e.get("type") == "checkpoint" and "-step-" in str(e.get("file"))]
    return {"seconds": seconds, "excess": excess, "steps": len(steps), "checkpoints": len(saved)}


def stall(run: dict[str, dict[str, Any]], variant: str) -> float | None:
    n = run[variant]["checkpoints"]
    return (run[variant]["excess"] - run["none"]["excess"]) / n if n else None


def _median(runs: list[dict[str, dict[str, Any]]], variant: str, key: str) -> Any:
    return summary([r[variant][key] for r in runs])["median"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192, help="synthetic training samples")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--every-s", type=float, default=1.0, help="checkpoint_every_s")
    parser.add_argument("--smoke", action="store_true", help="one short run")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.epochs, args.samples, args.width = 1, 1, 2048, 512

    runs: list[dict[str, dict[str, Any]]] = []
    with workdir("tj-bench-fsdp-") as scratch:
        for i in range(args.runs):
            run = {v: run_trainer(scratch / f"run{i}-{v}", args, v) for v in VARIANTS}
            runs.append(run)
            print(f"run {i + 1}: {json.dumps(run)}", file=sys.stderr, flush=True)

    pairs = [(stall(r, "async"), stall(r, "sync")) for r in runs]
    pairs_ok = [(a, s) for a, s in pairs if a is not None and s]
    setup = f"torchrun, cpu x2, mlp {args.depth}x{args.width}"
    params = 64 * args.width + (args.depth - 1) * args.width**2 + args.width * 10
    result: dict[str, Any] = {
        "name": "fsdp-checkpoint",
        "title": "fsdp: training stall per checkpoint, async DCP save against a synchronous dcp.save",
        "figures": [
            figure(
                "training held per checkpoint (median), async save",
                "s",
                [r["async"]["held"] for r in runs if r["async"]["held"] and r["sync"]["held"]],
                [r["sync"]["held"] for r in runs if r["async"]["held"] and r["sync"]["held"]],
                setup=setup,
                floor_name="synchronous dcp.save, the same loop",
                target="< 0.5",
                note="the training thread inside each save, rank 0's log; median per launch",
            ),
            figure(
                "stall per checkpoint, async save",
                "s",
                [a for a, _ in pairs_ok],
                [s for _, s in pairs_ok],
                setup=setup,
                floor_name="synchronous dcp.save, the same loop",
                target="< 1.0",
                note="step-time excess over the launch's median step, less the launch without checkpoints",
            ),
            *(
                figure(
                    f"training time with a checkpoint every {args.every_s:g} s, {v}",
                    "s",
                    [r[v]["seconds"] for r in runs],
                    [r["none"]["seconds"] for r in runs],
                    setup=setup,
                    floor_name="no checkpoint",
                    note=f"checkpoints while training: {_median(runs, v, 'checkpoints')}",
                )
                for v in ("async", "sync")
            ),
        ],
        "notes": [
            f"{params * 4 * 3 / 2**20:.0f} MiB of model and AdamW state per checkpoint (2 shards); "
            f"{args.samples} samples x {args.epochs} epoch(s), batch 32 per rank; {args.runs} run(s), "
            "ratios per run",
            "stall = (step-time excess over the launch's median step, with checkpoints - without) / "
            "checkpoints; training time is the trainer's own epoch timing (steps and saves between them)",
        ],
        "raw": runs,
    }
    write_result(args.json, result)
    print_figures(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
