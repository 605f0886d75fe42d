"""A CPU rank's share of the worker's cores: its slots' part of the CPUs the worker may use.

On a CPU worker a "GPU" slot is a process slot, and without this every rank (and every loader
worker it starts) runs on every core with a thread per core: two jobs side by side, or two DDP
ranks of one, each oversubscribe the machine. The worker's allowed CPUs (the affinity the rank
inherits) are cut, in order, into one near-equal contiguous block per worker slot; with fewer
CPUs than slots, slot s gets CPU s mod n, so slots share cores round-robin. A rank pins itself to
the blocks of the slots it holds (a DDP rank one, a single or dp process all of its node's) and
runs that many threads. Deterministic by slot index: which cores a slot means never depends on
what else runs. CUDA ranks are not pinned: their slots are GPUs, and their data path (loader
workers, pinned-memory copies) needs the cores. But their thread pool is capped at their slots'
share: a `single` or `dp` process (torchrun sets OMP_NUM_THREADS=1 only for several processes
per node) otherwise starts a thread per host core for CPU work, beside every other job's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from workers.runtime.env import RuntimeEnv
from workers.runtime.errors import ConfigError


def slot_cpus(slot: int, worker_slots: int, allowed: Sequence[int]) -> tuple[int, ...]:
    """The CPUs of one of the worker's slots, out of the worker's allowed CPUs."""
    if not 0 <= slot < worker_slots:
        raise ConfigError(f"slot {slot} is outside the worker's {worker_slots} slots")
    cpus = sorted(allowed)
    if not cpus:
        raise ConfigError("this process may run on no CPU")
    n = len(cpus)
    if n < worker_slots:
        return (cpus[slot % n],)
    return tuple(cpus[slot * n // worker_slots : (slot + 1) * n // worker_slots])


def rank_cpus(
    *,
    slots: Sequence[int],
    worker_slots: int,
    allowed: Sequence[int],
    local_rank: int,
    local_world_size: int,
) -> tuple[int, ...]:
    """The CPUs of one local rank: those of the node's slots it holds. The node's slots are dealt
    to its ranks in order (one each under DDP, all to the one process of single and dp)."""
    if not slots:
        raise ConfigError("no slots given")
    mine = list(slots[local_rank::local_world_size]) or [slots[local_rank % len(slots)]]
    return tuple(sorted({cpu for slot in mine for cpu in slot_cpus(slot, worker_slots, allowed)}))


def use_slot_cpus(env: RuntimeEnv) -> tuple[int, ...] | None:
    """Pin a CPU rank to its slots' CPUs and size torch's thread pool to them; cap a CUDA rank's
    thread pool at their number (never raising what OMP_NUM_THREADS set). None (nothing done)
    where the launch did not say which slots of how many the rank holds."""
    if env.slots is None or env.worker_slots is None:
        return None
    cpus = rank_cpus(
        slots=env.slots,
        worker_slots=env.worker_slots,
        allowed=sorted(os.sched_getaffinity(0)),
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
    )
    if env.accelerator == "cuda":
        torch.set_num_threads(min(torch.get_num_threads(), len(cpus)))
        return cpus
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    return cpus


def describe(cpus: Sequence[int]) -> str:
    """`CPUs 4-7 (4 threads)`, for the rank's log."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and cpu == int(ranges[-1].split("-")[-1]) + 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return f"CPUs {','.join(ranges)} ({len(cpus)} thread{'s' if len(cpus) != 1 else ''})"
