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


AFTER_PREFLIGHT = """
import os, torch
from workers.runtime.env import RuntimeEnv
from workers.runtime.preflight import check_gpus
check_gpus(RuntimeEnv(accelerator="cuda", local_world_size=1))
assert not torch.cuda.is_initialized(), "the pre-flight started CUDA in the rank's process"
os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LAST_GPU"]  # what a script may do itself
assert torch.cuda.device_count() == 1, torch.cuda.device_count()
print("ok")
"""


def test_a_script_choosing_its_own_gpu_after_the_preflight_gets_it() -> None:
    """CUDA reads CUDA_VISIBLE_DEVICES once per process: a pre-flight that initialised CUDA in
    the rank's interpreter would make the script's own choice a no-op (as under bare torchrun,
    it must not)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LAST_GPU": str(torch.cuda.device_count() - 1)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, "-c", AFTER_PREFLIGHT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
