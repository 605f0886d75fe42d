"""Factories that snoop (tests/integration/test_sandbox.py): the model factory runs
tests/scripts/snoop.py's snoop() inside the rank, then both return something trainable."""

from __future__ import annotations

import runpy

import torch
from torch import nn
from torch.utils.data import TensorDataset


def model() -> nn.Module:
    runpy.run_path(__import__("os").environ["SNOOP_SCRIPT"])["snoop"]()
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 2))


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 4, generator=gen), torch.randint(0, 2, (64,), generator=gen))
