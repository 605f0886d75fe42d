"""On a CUDA host only (no GPU has been lent to this project so far: docs/testing.md,
"What ran on a GPU"): the pre-flight's GPU check passes on every visible GPU, and names the
GPU it fails on."""

from __future__ import annotations

import pytest
import torch

from workers.runtime.env import RuntimeEnv
from workers.runtime.preflight import PreflightError, check_gpus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU host)")


def test_every_visible_gpu_passes_the_check() -> None:
    check_gpus(RuntimeEnv(accelerator="cuda", local_world_size=1))  # a DataParallel process: all of them
    check_gpus(RuntimeEnv(accelerator="cuda", local_world_size=2, local_rank=0))


def test_a_gpu_that_is_not_there_fails_the_preflight_naming_it() -> None:
    missing = torch.cuda.device_count()
    with pytest.raises(PreflightError, match=f"could not use GPU {missing}"):
        check_gpus(RuntimeEnv(accelerator="cuda", local_world_size=missing + 1, local_rank=missing))
