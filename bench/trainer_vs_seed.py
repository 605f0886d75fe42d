"""The builtin trainer's training throughput against a hand-written loop in the seed's style.

    .venv/bin/python bench/trainer_vs_seed.py            # single and 2-process ddp on CPU, ~1-2 min
    .venv/bin/python bench/trainer_vs_seed.py --runs 5 --epochs 6 --modes ddp
    .venv/bin/python bench/trainer_vs_seed.py --amp bf16       # autocast on both sides
    .venv/bin/python bench/trainer_vs_seed.py --compile        # torch.compile on both sides
    python3 bench/trainer_vs_seed.py --accelerator cuda --amp fp16 --nproc 1   # a GPU host

Both sides train the same model (builtin cnn) on the same data (builtin synthetic) with the same
batch size, each launched by torchrun exactly as a job is. Throughput is global samples per
second over the training steps of every epoch but the first (warm-up), excluding validation and
checkpoint writing on both sides: the trainer's epoch-end `samples_per_sec` reports, and the
loop's own timing of its `for batch in loader` epochs. Trainer and loop runs alternate, so drift
in the machine's speed hits both alike. The ratio trainer/seed is reported per run pair:
median, min and max. What the trainer adds per step is a loss accumulation on the device and,
in DDP, every ~0.2 s of training, a two-int asynchronous all-reduce that lets every rank agree
when to stop on SIGTERM (once per step until this session: about 6% of a 9 ms step).

With --seed-worker the file is the seed-style loop itself (what torchrun runs for that side).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ the seed's loop


def seed_worker(args: argparse.Namespace) -> None:
    """The seed's training loop (README pattern), with this project's model and data."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.accelerator == "cuda"
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.mode == "ddp":
        dist.init_process_group(backend="nccl" if cuda else "gloo", init_method="env://")
    torch.manual_seed(args.seed + rank)
    loader, sampler = _seed_loader(args, rank, world_size, pin_memory=cuda)
    net = _seed_model(args, device, local_rank)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-3)
    if args.compile:  # what the trainer compiles too: the model as it trains, wrapper and all
        # an nn.Module compiles to an nn.Module (OptimizedModule); the stubs say only "a callable"
        net = cast(torch.nn.Module, torch.compile(net))
    scaler = torch.amp.GradScaler("cuda") if args.amp == "fp16" else None
    per_epoch = []
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        per_epoch.append(_seed_epoch(args, net, optimizer, scaler, loader, device, world_size))
        if rank == 0:
            states = {"state_dict": {"net": net.state_dict()}, "optimizer": optimizer.state_dict()}
            torch.save(states, Path(args.out) / "seed.pt")
    if rank == 0:
        (Path(args.out) / "seed.json").write_text(json.dumps(per_epoch))
    if args.mode == "ddp":
        del net, optimizer  # the DDP wrapper holds the group: drop it, leave together, then destroy
        dist.barrier()
        dist.destroy_process_group()


def _seed_loader(
    args: argparse.Namespace, rank: int, world_size: int, *, pin_memory: bool
) -> tuple[DataLoader[Any], DistributedSampler[Any] | None]:
    """The builtin synthetic training data, each rank its own share of it in DDP."""
    from torch.utils.data import DataLoader, DistributedSampler

    from workers.runtime.trainer.data import builtin_datasets

    train_data, _ = builtin_datasets("synthetic", synthetic_size=args.synthetic_size)
    sampler: DistributedSampler[Any] | None = None
    if args.mode == "ddp":
        sampler = DistributedSampler(
            train_data, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True
        )
    loader = DataLoader(
        train_data,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        drop_last=True,
        num_workers=args.num_workers,
        pin_memory=pin_memory,
        persistent_workers=args.num_workers > 0,
    )
    return loader, sampler


def _seed_model(args: argparse.Namespace, device: torch.device, local_rank: int) -> torch.nn.Module:
    """The builtin cnn on `device`; in DDP with synchronised BatchNorm, wrapped in DDP."""
    import torch

    from workers.runtime.trainer.models import build_cnn
    from workers.runtime.trainer.syncbn import convert_distributed_batchnorm

    net = build_cnn().to(device)
    if args.mode != "ddp":
        return net
    cuda = device.type == "cuda"
    # The seed converts to native SyncBatchNorm, which refuses CPU modules: on CPU it gets the
    # same synchronised BatchNorm the trainer uses, so both sides pay the same BN cost.
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net) if cuda else convert_distributed_batchnorm(net)
    return torch.nn.parallel.DistributedDataParallel(
        net.to(device), device_ids=[local_rank] if cuda else None, broadcast_buffers=False
    )


def _seed_epoch(
    args: argparse.Namespace,
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    loader: DataLoader[Any],
    device: torch.device,
    world_size: int,
) -> float:
    """One epoch of the seed's loop; global samples per second over its training steps."""
    import torch
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    steps, t0 = 0, time.perf_counter()
    for x, y in loader:
        x, y = x.to(device, non_blocking=cuda), y.to(device, non_blocking=cuda)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        steps += 1
    if cuda:
        torch.cuda.synchronize()
    return steps * args.batch_size * world_size / (time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------ the driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, target: list[str], env: dict[str, str], cwd: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--node-rank=0",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        *target,
    ]
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHJOBS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    return env


def run_trainer(args: argparse.Namespace, mode: str, workdir: Path) -> float:
    """Median epoch-end samples/sec of the builtin trainer, epochs after the first."""
    config = {
        "mode": mode,
        "accelerator": args.accelerator,
        "gpus_per_node": 1,
        "entrypoint": {"kind": "builtin", "model": "cnn", "dataset": "synthetic"},
        "hyperparameters": {
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "num_workers": args.num_workers,
            "synthetic_size": args.synthetic_size,
            "checkpoint_every": 1,
            "report_every": 1_000_000,
            "amp": args.amp,
            "compile": args.compile,
        },
    }
    (workdir / "config.json").write_text(json.dumps(config))
    events = workdir / "events.jsonl"
    env = _env(TORCHJOBS_EVENTS=str(events), TORCHJOBS_CHECKPOINT_DIR=str(workdir / "ck"))
    _torchrun(
        args.nproc if mode == "ddp" else 1,
        ["-m", "workers.runtime.trainer.train", "--config", "config.json"],
        env,
        workdir,
    )
    ends = [e for e in map(json.loads, events.read_text().splitlines()) if "val_loss" in e]
    return _after_warmup([e["samples_per_sec"] for e in ends])


def run_seed(args: argparse.Namespace, mode: str, workdir: Path) -> float:
    """Median samples/sec of the seed-style loop, epochs after the first."""
    target = [
        str(Path(__file__).resolve()),
        "--seed-worker",
        "--mode",
        mode,
        "--out",
        str(workdir),
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--seed",
        str(args.seed),
        "--num-workers",
        str(args.num_workers),
        "--synthetic-size",
        str(args.synthetic_size),
        "--accelerator",
        args.accelerator,
        *(["--amp", args.amp] if args.amp else []),
        *(["--compile"] if args.compile else []),
    ]
    _torchrun(args.nproc if mode == "ddp" else 1, target, _env(), workdir)
    return _after_warmup(json.loads((workdir / "seed.json").read_text()))


def _after_warmup(per_epoch: list[float]) -> float:
    """Median over the epochs after the first (all of them if there is only one)."""
    return statistics.median(per_epoch[1:] or per_epoch)


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainer-vs-seed-") as tmp:
        for mode in args.modes:
            trainer: list[float] = []
            seed: list[float] = []
            for i in range(args.runs):
                for side, fn, out in (("trainer", run_trainer, trainer), ("seed", run_seed, seed)):
                    workdir = Path(tmp) / f"{mode}-{side}-{i}"
                    workdir.mkdir()
                    out.append(fn(args, mode, workdir))
            ratios = [t / s for t, s in zip(trainer, seed, strict=True)]
            rows.append(
                {
                    "mode": mode if mode == "single" else f"ddp x{args.nproc}",
                    "trainer": statistics.median(trainer),
                    "seed": statistics.median(seed),
                    "ratio": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"cnn on synthetic ({args.synthetic_size} samples), batch {args.batch_size} per process, "
        f"{args.accelerator}, num_workers={args.num_workers}, amp={args.amp}, compile={args.compile}, "
        f"{args.epochs} epochs (first excluded), {args.runs} runs each; global samples/sec"
    )
    print(f"{'mode':<10} {'trainer':>10} {'seed loop':>10} {'ratio':>7} {'min':>7} {'max':>7}")
    for r in rows:
        print(
            f"{r['mode']:<10} {r['trainer']:>10.0f} {r['seed']:>10.0f} "
            f"{r['ratio']:>7.3f} {r['min']:>7.3f} {r['max']:>7.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--modes", nargs="+", default=["single", "ddp"], choices=["single", "ddp"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--synthetic-size", type=int, default=12288)
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--amp", choices=["bf16", "fp16"], help="autocast on both sides (fp16: CUDA only)")
    parser.add_argument("--compile", action="store_true", help="torch.compile on both sides")
    args = parser.parse_args()
    if args.seed_worker:
        seed_worker(args)
        return
    started = time.perf_counter()
    rows = compare(args)
    print_table(rows, args)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
