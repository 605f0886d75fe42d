"""Mode `dp`: a failing replica's own error is what surfaces, every device's RNG state travels
in the checkpoint, and on the CPU the job says that it is single-process training.

Real multi-GPU DataParallel cannot run here; its replicas are run the way DataParallel runs them
(threads, errors wrapped and re-raised in replica order, as `parallel_apply` does), on CPU.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._utils import ExceptionWrapper

from tests.workers.runtime.test_runtime_syncbn import cpu_replicate
from workers.runtime.trainer.rng import capture_rng, restore_rng
from workers.runtime.trainer.syncbn import (
    SiblingReplicaFailed,
    apply_replicas,
    attach_replica_sync,
    convert_replica_batchnorm,
    guard_replicas,
)

OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.10 GiB"


def parallel_apply_like_torch(
    replicas: Sequence[Callable[..., Any]], inputs: Sequence[Any], kwargs: Any
) -> list[Any]:
    """torch.nn.parallel.parallel_apply's error handling, without its accelerator: each replica
    in a thread, an exception kept as an ExceptionWrapper, the first in replica order re-raised."""
    results: dict[int, Any] = {}
    lock = threading.Lock()

    def work(i: int) -> None:
        try:
            out = replicas[i](inputs[i])
        except Exception:
            out = ExceptionWrapper(where=f"in replica {i} on device {i}")
        with lock:
            results[i] = out

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    outputs = []
    for i in range(len(replicas)):
        if isinstance(results[i], ExceptionWrapper):
            results[i].reraise()
        outputs.append(results[i])
    return outputs


def _replicas_where_the_second_runs_out_of_memory() -> tuple[list[Callable[..., Any]], list[Any], list[Any]]:
    torch.manual_seed(0)
    model = convert_replica_batchnorm(nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU()))
    replicas = cpu_replicate(model.train(), 2)
    syncs = attach_replica_sync(replicas)

    def out_of_memory(x: torch.Tensor) -> torch.Tensor:  # before it reaches the BatchNorm
        raise torch.OutOfMemoryError(OOM_MESSAGE)

    inputs = list(torch.randn(4, 2, 5, 5).split(2))
    return [replicas[0], out_of_memory], syncs, inputs


def test_the_sibling_error_used_to_hide_the_replicas_own() -> None:
    """What parallel_apply alone reports: replica 0's knock-on error, raised first by index."""
    replicas, syncs, inputs = _replicas_where_the_second_runs_out_of_memory()
    with pytest.raises(SiblingReplicaFailed, match="did not reach synchronised BatchNorm"):
        parallel_apply_like_torch(guard_replicas(replicas, syncs), inputs, None)


def test_a_replica_out_of_memory_surfaces_as_out_of_memory() -> None:
    replicas, syncs, inputs = _replicas_where_the_second_runs_out_of_memory()
    with pytest.raises(torch.OutOfMemoryError) as raised:
        apply_replicas(parallel_apply_like_torch, replicas, syncs, inputs, None)
    assert str(raised.value) == OOM_MESSAGE
    assert any("replica 1" in note for note in getattr(raised.value, "__notes__", []))
    # What @record writes to the error file: it now carries the markers by which
    # workers/launcher/failure.py classifies an OOM (the job's own failure, never retried), as
    # it does for an OOM in single or ddp.
    text = "".join(traceback.format_exception(raised.value))
    assert "torch.OutOfMemoryError: CUDA out of memory" in text
    assert "did not reach synchronised BatchNorm" not in text


def test_without_a_root_cause_the_siblings_error_stands() -> None:
    """A replica that only timed out leaves nothing better to report than the timeout."""
    replicas, syncs, inputs = _replicas_where_the_second_runs_out_of_memory()
    syncs[0].abort()  # as if a sibling had gone silent past the barrier's timeout
    with pytest.raises(SiblingReplicaFailed):
        apply_replicas(parallel_apply_like_torch, replicas[:1] * 2, syncs, inputs, None)


# ------------------------------------------------------------------------------------------ RNG


def test_a_cpu_process_saves_no_cuda_state_and_resumes_a_gpu_checkpoint() -> None:
    state = capture_rng(cuda=False)
    assert "cuda" not in state and "cuda_all" not in state
    first = torch.rand(3)
    restore_rng(
        {
            **state,
            "cuda": torch.zeros(16, dtype=torch.uint8),
            "cuda_all": [torch.zeros(16, dtype=torch.uint8)],
        }
    )
    assert torch.equal(torch.rand(3), first)


# ------------------------------------------------------------------------------------------ dp on the CPU


def test_dp_on_the_cpu_says_it_is_single_process_training(jobs: Any, tmp_path: Path) -> None:
    config = jobs.config("dp", epochs=1, synthetic_size=128)
    config["gpus_per_node"] = 2
    run = jobs.start(tmp_path / "dp", config, torchrun=False).ok()
    assert "mode dp on the CPU is single-process training on one device" in run.output
    single = jobs.start(
        tmp_path / "single", jobs.config("single", epochs=1, synthetic_size=128), torchrun=False
    )
    assert "single-process training" not in single.ok().output
