"""One rank of the DDP buffer test (`test_runtime_ddp_knobs.py`), run as its own process:
`python -m tests.workers.runtime.ddp_buffer_ranks RANK OUT_DIR`.

A plain subprocess per rank rather than `torch.multiprocessing`: the test holds each with a
deadline and, if one hangs, kills both and shows what they printed (an earlier form of this
test, spawned from inside pytest, hung once in CI with nothing to show). Gloo is pinned to the
loopback: the suite makes and removes network interfaces while it runs, and gloo otherwise
picks the interface its host name resolves to. The rank leaves the group and exits as the
builtin trainer does (`teardown_distributed`, `run_then_exit`): a plain
`destroy_process_group()` here once hung rank 1 at exit (../../../workers/runtime/process_groups.py).

The ranks meet through torch's file store in OUT_DIR, not a TCP store on a port the test
chose: such a port, released before rank 0 bound it, was once reachable by neither rank in CI
(both timed out connecting to it, 2026-12-07). Gloo's own connections take ports the kernel
gives them."""

from __future__ import annotations

import sys
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


def run(rank: int, out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir / 'store'}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
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
