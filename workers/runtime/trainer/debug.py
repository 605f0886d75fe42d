"""Test-only dumps, enabled by TORCHJOBS_DEBUG_DUMP_DIR: after every epoch each rank writes
`rank{R}-epoch{E}.pt` with the sample indices it trained on, in order, and its BatchNorm buffers.

They let tests check what cannot be seen from outside a rank: that DDP ranks saw disjoint
halves of the data, that the order changes between epochs, and that synchronised BatchNorm
left identical running statistics on every rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def batchnorm_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every BatchNorm buffer of the (unwrapped) model, by its state-dict name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            for buf_name, buf in module.named_buffers(recurse=False):
                out[f"{name}.{buf_name}"] = buf.detach().cpu().clone()
    return out


def dump_epoch(directory: Path, *, rank: int, epoch: int, batches: list[list[int]], model: nn.Module) -> None:
    """Write one rank's record of one epoch (epoch counts from 0)."""
    directory.mkdir(parents=True, exist_ok=True)
    indices = torch.tensor([i for batch in batches for i in batch], dtype=torch.int64)
    record = {"rank": rank, "epoch": epoch, "indices": indices, "bn": batchnorm_buffers(model)}
    torch.save(record, directory / f"rank{rank}-epoch{epoch:04d}.pt")
