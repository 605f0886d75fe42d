"""A factory model's own buffers under DDP (#37): equal on every rank from the first step
(rank 0's), and kept equal before every step with `sync_buffers: step`; DDP's
`find_unused_parameters` for a model that skips a parameter. Two real gloo processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from workers.runtime.trainer.config import Hyperparameters
from workers.runtime.trainer.parallel import place_model
from workers.runtime.trainer.plan import RunPlan


class Drifting(nn.Module):
    """A buffer drawn per rank (as an unseeded factory would) that the forward also moves, and a
    head used only on even calls (DDP then needs find_unused_parameters)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)
        self.register_buffer("table", torch.full((3,), float(rank + 1)))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.table += 1.0  # buffers drift during training: only a per-step sync keeps them equal
        out = self.body(x)
        return self.spare(out) if self.calls % 2 == 0 else out


def _rank(rank: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        plan = RunPlan(
            mode="ddp",
            accelerator="cpu",
            device="cpu",
            backend="gloo",
            rank=rank,
            local_rank=rank,
            world_size=2,
        )
        seen: dict[str, Any] = {}
        for sync in ("init", "step"):
            model = Drifting(rank)
            hp = Hyperparameters(sync_buffers=sync, find_unused_parameters=True)
            placed = place_model(model, plan, hp)
            seen[f"{sync}-start"] = model.table.clone()
            for _ in range(2):
                placed.train(torch.ones(2, 4) * (rank + 1)).sum().backward()
            seen[f"{sync}-after"] = model.table.clone()
        torch.save(seen, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("ddp-knobs")
    mp.start_processes(
        _rank, args=(f"file://{folder / 'store'}", str(folder)), nprocs=2, start_method="spawn"
    )
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_buffers_start_as_rank_0s_on_every_rank(ranks: list[dict[str, torch.Tensor]]) -> None:
    for sync in ("init", "step"):
        assert torch.equal(ranks[0][f"{sync}-start"], torch.full((3,), 1.0))
        assert torch.equal(ranks[1][f"{sync}-start"], ranks[0][f"{sync}-start"])


def test_a_per_step_sync_keeps_drifting_buffers_equal(ranks: list[dict[str, torch.Tensor]]) -> None:
    """Both ranks moved their buffer twice; with a per-step sync each forward starts from rank
    0's, and the skipped head did not stop the backward (find_unused_parameters)."""
    assert torch.equal(ranks[0]["step-after"], ranks[1]["step-after"])
    assert torch.equal(ranks[0]["init-after"], torch.full((3,), 3.0))


def test_the_knobs_are_checked() -> None:
    from workers.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="sync_buffers must be init or step"):
        Hyperparameters(sync_buffers="always")
    with pytest.raises(ConfigError, match="static_graph must be true or false"):
        Hyperparameters(static_graph="yes")  # type: ignore[arg-type]
