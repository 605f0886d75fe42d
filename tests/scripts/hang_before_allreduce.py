"""The hang of contract §8: rank 1 never reaches its first all-reduce, rank 0 waits in it.

Each rank says it is ready, once; after that nothing from either rank, ever."""

import time

import torch
import torch.distributed as dist


def wait_forever_before_allreduce() -> None:
    while True:
        time.sleep(1)


dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} ready", flush=True)
if dist.get_rank() == 1:
    wait_forever_before_allreduce()
total = torch.ones(1)
dist.all_reduce(total)
