"""A training script in the ordinary torchrun style, knowing nothing of torchjobs except the
checkpoint folder and (optionally) report(): it must run through the service unchanged."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="env://", world_size=world_size, rank=rank)
torch.manual_seed(0)

data = TensorDataset(torch.randn(512, 10), torch.randint(0, 2, (512,)))
sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
net = DDP(torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
    print(f"rank {rank} local {local_rank} epoch {epoch} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        try:
            from workers.runtime import report

            report(epoch=epoch + 1, epochs=2, loss=loss.item())
        except ImportError:
            pass
        torch.save(
            {"state_dict": {"net": net.module.state_dict()}, "epoch": epoch + 1},
            os.path.join(os.environ["TORCHJOBS_CHECKPOINT_DIR"], f"plain-{epoch + 1}.pt"),
        )
    dist.barrier()
dist.destroy_process_group()
