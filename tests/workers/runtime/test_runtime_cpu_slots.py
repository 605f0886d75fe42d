"""A CPU rank's share of the worker's cores (workers/runtime/cpus.py): the pure mapping from
(slots, allowed CPUs, local rank) to a CPU set, and what a real rank under torchrun ends up with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.testing.harness import free_port
from workers.runtime.cpus import describe, rank_cpus, slot_cpus
from workers.runtime.env import RuntimeEnv
from workers.runtime.errors import ConfigError


@pytest.mark.parametrize(
    ("allowed", "worker_slots"),
    [(range(8), 4), (range(10), 4), (range(16), 3), ([2, 3, 5, 7, 11, 13], 3), (range(4), 4), (range(7), 1)],
)
def test_with_enough_cpus_each_slot_gets_a_contiguous_near_equal_block(
    allowed: Any, worker_slots: int
) -> None:
    blocks = [slot_cpus(s, worker_slots, list(allowed)) for s in range(worker_slots)]
    assert [cpu for block in blocks for cpu in block] == sorted(allowed)  # all of them, once, in order
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_examples() -> None:
    assert slot_cpus(0, 4, range(8)) == (0, 1) and slot_cpus(3, 4, range(8)) == (6, 7)
    assert [slot_cpus(s, 4, range(10)) for s in range(4)] == [(0, 1), (2, 3, 4), (5, 6), (7, 8, 9)]
    assert slot_cpus(1, 2, [13, 5, 7, 2]) == (7, 13)  # the allowed set's order, not the caller's


def test_with_fewer_cpus_than_slots_slots_share_them_round_robin() -> None:
    assert [slot_cpus(s, 5, [4, 9]) for s in range(5)] == [(4,), (9,), (4,), (9,), (4,)]


def test_a_rank_takes_the_slots_it_holds() -> None:
    def cpus(local_rank: int, local_world_size: int, allowed: Any = range(8)) -> tuple[int, ...]:
        return rank_cpus(
            slots=(2, 3),
            worker_slots=4,
            allowed=allowed,
            local_rank=local_rank,
            local_world_size=local_world_size,
        )

    assert (cpus(0, 2), cpus(1, 2)) == ((4, 5), (6, 7))  # ddp on slots 2 and 3: one slot per rank
    assert cpus(0, 1) == (4, 5, 6, 7)  # single or dp: one process holds both slots
    assert cpus(1, 2, allowed=[0, 1]) == (1,)  # the same slots on 2 CPUs: round robin


def test_slots_outside_the_worker_or_no_cpu_are_errors() -> None:
    with pytest.raises(ConfigError, match="outside the worker's 2 slots"):
        slot_cpus(2, 2, range(4))
    with pytest.raises(ConfigError, match="no CPU"):
        slot_cpus(0, 2, [])


def test_the_environment_carries_the_slots() -> None:
    env = RuntimeEnv.from_environ({"TORCHJOBS_SLOTS": "2,3", "TORCHJOBS_WORKER_SLOTS": "4"})
    assert (env.slots, env.worker_slots) == ((2, 3), 4)
    assert RuntimeEnv.from_environ({}).slots is None
    with pytest.raises(ConfigError, match="comma-separated integers"):
        RuntimeEnv.from_environ({"TORCHJOBS_SLOTS": "2;3"})


def test_describe() -> None:
    assert describe([7, 4, 5, 6, 9]) == "CPUs 4-7,9 (5 threads)"
    assert describe([3]) == "CPUs 3 (1 thread)"


PROBE = """
import json, os, sys
import torch
from pathlib import Path
seen = {"cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}
Path(sys.argv[1], "rank-" + os.environ["RANK"] + ".json").write_text(json.dumps(seen))
"""


def _ranks(
    jobs: Any, tmp_path: Path, name: str, nproc: int, slots: str, worker_slots: int
) -> list[dict[str, Any]]:
    """What each rank of a script job sees, launched as the platform launches one."""
    out = tmp_path / name
    out.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "workers.runtime.script",
        str(probe),
        str(out),
    ]
    env = jobs.child_env(
        TORCHJOBS_ACCELERATOR="cpu", TORCHJOBS_SLOTS=slots, TORCHJOBS_WORKER_SLOTS=str(worker_slots)
    )
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


def test_real_ranks_run_on_their_slots_cpus_with_as_many_threads(jobs: Any, tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    # two ddp ranks on slots 0 and 1 of a 2-slot worker: half the CPUs each
    for local_rank, seen in enumerate(_ranks(jobs, tmp_path, "ddp", 2, "0,1", 2)):
        want = rank_cpus(
            slots=(0, 1), worker_slots=2, allowed=allowed, local_rank=local_rank, local_world_size=2
        )
        assert seen == {"cpus": list(want), "threads": len(want)}, local_rank
    # one process holding both slots (single, dp): every CPU, one thread per CPU (the test
    # environment sets OMP_NUM_THREADS=1, so the thread count is the runtime's doing)
    (seen,) = _ranks(jobs, tmp_path, "one", 1, "0,1", 2)
    assert seen == {"cpus": allowed, "threads": len(allowed)}


CUDA_CAP_PROBE = """
import json, os
import torch
from workers.runtime.cpus import use_slot_cpus
from workers.runtime.env import RuntimeEnv
torch.set_num_threads(len(os.sched_getaffinity(0)))
env = RuntimeEnv.from_environ(
    {"TORCHJOBS_ACCELERATOR": "cuda", "TORCHJOBS_SLOTS": "0", "TORCHJOBS_WORKER_SLOTS": "2"}
)
cpus = use_slot_cpus(env)
print(json.dumps({"cpus": list(cpus), "threads": torch.get_num_threads(),
                  "affinity": sorted(os.sched_getaffinity(0))}))
"""


def test_a_cuda_rank_is_capped_at_its_slots_share_of_threads_not_pinned() -> None:
    """A `single` CUDA process on one GPU of a 2-GPU worker: half the cores' worth of threads
    (not one per host core beside every other job's), its affinity untouched (loader workers and
    pinned-memory copies use every core)."""
    allowed = sorted(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", CUDA_CAP_PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(done.stdout)
    want = rank_cpus(slots=(0,), worker_slots=2, allowed=allowed, local_rank=0, local_world_size=1)
    assert seen == {"cpus": list(want), "threads": len(want), "affinity": allowed}
