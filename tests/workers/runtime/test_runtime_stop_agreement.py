"""The ranks' SIGTERM agreement across 2 real gloo processes: spaced exchanges, the same
decision on the same step everywhere, at the pace of the slowest rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from workers.runtime.trainer.distributed import (
    STOP_EXCHANGE_MAX_STEPS,
    STOP_EXCHANGE_S,
    DistContext,
    StopAgreement,
    exchange_every,
)

STEP_S = [0.002, 0.025]  # rank 1 is the slow one: the spacing must follow it
SIGNAL_AT = {0: None, 1: 40}  # only rank 1 receives SIGTERM, at its 40th step
STEPS = 200


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _rank(rank: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        clock = FakeClock()
        stop = StopAgreement(DistContext(rank=rank, world_size=2, device=torch.device("cpu")), clock=clock)
        exchanges, stopped_at = [], None
        signal_at = SIGNAL_AT[rank]
        for step in range(1, STEPS + 1):
            clock.now += STEP_S[rank]
            before = stop.every
            if stop.after_step(signal_at is not None and step >= signal_at):
                stopped_at = step
                break
            exchanges.append(before)
        record = {"stopped_at": stopped_at, "every": stop.every, "exchanges": exchanges}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def test_ranks_stop_on_the_same_step_with_spacing_set_by_the_slowest(tmp_path: Path) -> None:
    mp.start_processes(
        _rank, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, start_method="spawn"
    )
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1]  # same spacing history, same stop step
    expected_every = exchange_every(STEP_S[1])
    assert got[0]["every"] == expected_every == int(STOP_EXCHANGE_S / STEP_S[1])
    stopped = got[0]["stopped_at"]
    assert stopped is not None
    # flag posted at the first exchange at or after step 40, read at the next one
    assert SIGNAL_AT[1] < stopped <= SIGNAL_AT[1] + 2 * expected_every


def test_exchange_spacing_is_bounded() -> None:
    assert exchange_every(0.0) == 1
    assert exchange_every(10.0) == 1  # slow steps: every step, as before
    assert exchange_every(1e-6) == STOP_EXCHANGE_MAX_STEPS
    assert exchange_every(STOP_EXCHANGE_S / 5) == 5
