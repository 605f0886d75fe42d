"""A factory model's own buffers under DDP (#37): equal on every rank from the first step
(rank 0's), and kept equal before every step with `sync_buffers: step`; DDP's
`find_unused_parameters` for a model that skips a parameter. Two real gloo processes
(`ddp_buffer_ranks.py`), each held to a deadline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.runtime.trainer.config import Hyperparameters

ROOT = Path(__file__).resolve().parents[3]
DEADLINE_S = 240


def _stacks(pid: int) -> str:
    """Where a hung rank is, Python and native frames (py-spy, a dependency)."""
    try:
        dump = subprocess.run(
            [str(Path(sys.executable).with_name("py-spy")), "dump", "--native", "--pid", str(pid)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy failed: {exc}"
    return dump.stdout + dump.stderr


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("ddp-knobs")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.workers.runtime.ddp_buffer_ranks", str(r), str(folder)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=DEADLINE_S)[0])
    except subprocess.TimeoutExpired:
        stacks = [_stacks(proc.pid) for proc in procs]
        for proc in procs:
            proc.kill()
        shown = [p.communicate()[0] for p in procs]
        pytest.fail(f"the two gloo ranks did not end in {DEADLINE_S} s; printed: {shown}; stacks: {stacks}")
    assert [p.returncode for p in procs] == [0, 0], outputs
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.torchrun
def test_buffers_start_as_rank_0s_on_every_rank(ranks: list[dict[str, torch.Tensor]]) -> None:
    assert torch.equal(ranks[0]["broadcast"], torch.full((3,), 1.0))
    assert torch.equal(ranks[1]["broadcast"], ranks[0]["broadcast"])
    for sync in ("init", "step"):
        assert torch.equal(ranks[1][f"{sync}-starts"][0], ranks[0][f"{sync}-starts"][0])


@pytest.mark.torchrun
def test_a_per_step_sync_keeps_drifting_buffers_equal(ranks: list[dict[str, torch.Tensor]]) -> None:
    """Each rank moves its buffer by its own amount in every forward. With a per-step sync each
    forward starts from rank 0's; without, the second forward finds them apart. The skipped
    head did not stop the backward (find_unused_parameters)."""
    assert torch.equal(ranks[0]["step-starts"], ranks[1]["step-starts"])
    assert not torch.equal(ranks[0]["init-starts"][1], ranks[1]["init-starts"][1])


def test_the_knobs_are_checked() -> None:
    from workers.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="sync_buffers must be init or step"):
        Hyperparameters(sync_buffers="always")
    with pytest.raises(ConfigError, match="static_graph must be true or false"):
        Hyperparameters(static_graph="yes")  # type: ignore[arg-type]
