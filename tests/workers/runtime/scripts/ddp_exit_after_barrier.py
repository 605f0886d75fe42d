"""A DDP rank that ends right after a barrier: the shape that aborted at interpreter exit
("terminate called without an active exception") before ranks left through run_then_exit."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.runtime.exiting import run_then_exit


def main() -> int:
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.ones(3, 4)).sum().backward()
    for _ in range(3):
        out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object({"rank": dist.get_rank(), "state": torch.randn(8)}, out, dst=0)
        dist.barrier()
    del model
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_then_exit(main)
