"""One rank of the DDP buffer test (`test_runtime_ddp_knobs.py`), run as its own process:
`python -m tests.workers.runtime.ddp_buffer_ranks RANK OUT_DIR`.

A plain subprocess per rank rather than `torch.multiprocessing`: the test holds each with a
deadline and, if one hangs, kills both and shows what they printed (an earlier form of this
test, spawned from inside pytest, hung once in CI with nothing to show). Gloo is pinned to the
loopback: the suite makes and removes network interfaces while it runs, and gloo otherwise
picks the interface its host name resolves to. The rank leaves the group and exits as the
builtin trainer does (`teardown_distributed`, `run_then_exit`): a plain
`destroy_process_group()` here once hung rank 1 at exit (../../../workers/runtime/process_groups.py).

Rank 0's store takes a port the kernel gives it and writes it to OUT_DIR/port for rank 1: a
port chosen by the test and released before rank 0 bound it was once not reachable by either
rank in CI (both timed out connecting to it, 2026-12-07), and nothing can take this one."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workers.runtime.exiting import run_then_exit
from workers.runtime.trainer.config import Hyperparameters
from workers.runtime.trainer.distributed import teardown_distributed
from workers.runtime.trainer.parallel import broadcast_buffers, place_model
from workers.runtime.trainer.plan import RunPlan

WORLD = 2


class Drifting(nn.Module):
    """A buffer drawn per rank (as an unseeded factory would) that the forward also moves, and a
    head used only on even calls (DDP then needs find_unused_parameters)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)
        self.register_buffer("table", torch.full((3,), float(rank + 1)))
        self.rank = rank
        self.calls = 0
        self.starts: list[torch.Tensor] = []  # the buffer as each forward found it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.starts.append(self.table.clone())
        self.table += float(self.rank + 1)  # drifts apart: only a per-step sync keeps it equal
        out = self.body(x)
        return self.spare(out) if self.calls % 2 == 0 else out


TIMEOUT = timedelta(seconds=60)


def rendezvous(rank: int, out_dir: Path) -> dist.TCPStore:
    published = out_dir / "port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        (out_dir / "port.part").write_text(str(store.port))
        os.replace(out_dir / "port.part", published)  # whole or absent for rank 1
        return store
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while not published.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no port in {published}")
        time.sleep(0.05)
    return dist.TCPStore("127.0.0.1", int(published.read_text()), WORLD, is_master=False, timeout=TIMEOUT)


def run(rank: int, out_dir: Path) -> None:
    torch.set_num_threads(1)
    store = rendezvous(rank, out_dir)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        plan = RunPlan(
            mode="ddp", accelerator="cpu", device="cpu", backend="gloo",
            rank=rank, local_rank=rank, world_size=WORLD,
        )  # fmt: skip
        seen: dict[str, Any] = {}
        bare = Drifting(rank)
        broadcast_buffers(bare)  # by itself: DDP's constructor also syncs them on some versions
        seen["broadcast"] = bare.table.clone()
        for sync in ("init", "step"):
            model = Drifting(rank)
            placed = place_model(model, plan, Hyperparameters(sync_buffers=sync, find_unused_parameters=True))
            seen[f"{sync}-start"] = model.table.clone()
            for _ in range(2):
                placed.train(torch.ones(2, 4) * (rank + 1)).sum().backward()
            seen[f"{sync}-starts"] = torch.stack(model.starts)
        torch.save(seen, out_dir / f"rank{rank}.pt")
    finally:
        teardown_distributed()


if __name__ == "__main__":
    run_then_exit(lambda: run(int(sys.argv[1]), Path(sys.argv[2])))
