"""On a CUDA host only: `mode: fsdp` over nccl (one process per GPU, `set_device(LOCAL_RANK)`,
the DeviceMesh on "cuda"), its DCP folders written asynchronously from the GPU (the shards are
staged to CPU memory, DCP's own collectives on a gloo group), and a resume on one GPU loading
the saved tensors. The CPU half (resharding on 1 and 3 ranks, exact resume, SIGTERM) is
tests/workers/runtime/test_runtime_fsdp.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bash .ci/gpu)")


def _fsdp_config(jobs: Any, gpus: int, epochs: int) -> dict[str, Any]:
    config = jobs.config("fsdp", epochs=epochs)
    config.update(accelerator="cuda", gpus_per_node=gpus)
    return config


def test_fsdp_over_nccl_writes_dcp_folders_that_resume_on_one_gpu(jobs: Any, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    n = min(2, torch.cuda.device_count())
    run = jobs.start(tmp_path / "fsdp", _fsdp_config(jobs, n, 2), nproc=n).ok()
    lines = re.findall(r"\] placement: (.*)", run.output)
    assert sorted(line.split(" ")[0] for line in lines) == [f"cuda:{i}" for i in range(n)], lines
    assert all(line.endswith("backend nccl") for line in lines), lines
    folder = run.checkpoints / "epoch-0002"
    assert (folder / ".metadata").is_file()
    assert sorted(p.name for p in folder.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(n)]

    resumed = jobs.start(
        tmp_path / "one",
        _fsdp_config(jobs, 1, 3),
        nproc=1,
        resume=folder,
        TORCHJOBS_DEBUG_DUMP_DIR=str(tmp_path / "dump"),
    ).ok()
    dcp_to_torch_save(folder, tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)["model"]
    loaded = torch.load(tmp_path / "dump" / "full-resumed.pt", weights_only=True)["model"]
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert torch.equal(saved[name].cpu(), loaded[name].cpu()), name
    assert (resumed.checkpoints / "epoch-0003" / ".metadata").is_file()
