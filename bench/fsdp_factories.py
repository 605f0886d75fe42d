"""Factories for `bench/fsdp_checkpoint.py`, imported inside the ranks (torch only, no service
stack): a wide MLP whose checkpoint is big enough for its write to take real time, and the
builtin synthetic dataset. Sizes come from the environment (factories take no arguments)."""

from __future__ import annotations

import os

from torch import nn
from torch.utils.data import Dataset

from workers.runtime.trainer.data import IMAGE_SHAPE, NUM_CLASSES, builtin_datasets


def wide_mlp() -> nn.Module:
    """Flatten, then `BENCH_FSDP_DEPTH` hidden layers of `BENCH_FSDP_WIDTH` units, then the head."""
    width = int(os.environ.get("BENCH_FSDP_WIDTH", "1024"))
    depth = int(os.environ.get("BENCH_FSDP_DEPTH", "3"))
    inputs = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, NUM_CLASSES))


def synthetic() -> tuple[Dataset, Dataset | None]:
    return builtin_datasets("synthetic", synthetic_size=int(os.environ.get("BENCH_FSDP_SAMPLES", "8192")))
