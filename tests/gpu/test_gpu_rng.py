"""On a CUDA host only: a checkpoint's RNG section holds every device's generator (issue #22),
and restoring it replays each device's stream. The CPU half (no CUDA state saved, a GPU
checkpoint resumed on a CPU process) is tests/workers/runtime/test_runtime_dp.py."""

from __future__ import annotations

import pytest
import torch

from workers.runtime.trainer.rng import capture_rng, restore_rng

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU host)")


def test_every_cuda_devices_generator_is_saved_and_restored() -> None:
    devices = range(torch.cuda.device_count())
    state = capture_rng(cuda=True)
    assert len(state["cuda_all"]) == torch.cuda.device_count()
    first = [torch.rand(4, device=f"cuda:{d}").cpu() for d in devices]
    restore_rng(state)
    again = [torch.rand(4, device=f"cuda:{d}").cpu() for d in devices]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
