"""Which running jobs a queued job may preempt (contract §12), as a pure function.

The fewest running preemptible jobs of strictly lower priority whose GPUs make the waiting
job fit; among as few, the first in this order: lowest priority first, then those of the
owner holding the most GPUs, then the most recently started. Exact (every combination of
that size, in that order) while the candidates are few; past `MAX_TRIES` fits tried, greedy
in the same order, then pruned of what turned out not to be needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import combinations

MAX_TRIES = 20_000  # fits tried exactly before the greedy choice takes over


@dataclass(frozen=True, kw_only=True)
class RunningJob:
    """A job holding GPUs, as preemption sees it: `slots` is GPUs held per host."""

    id: int
    priority: int
    owner: int
    started: float  # seconds since the epoch (when it started running; later: preempted first)
    preemptible: bool = True
    slots: dict[str, int] = field(default_factory=dict)
    stopping: bool = False  # already being stopped (preempted, drained, cancelled): no candidate
    for_job: int | None = None  # while it is being preempted: the job its GPUs are for


def fits(nodes: int, gpus_per_node: int, free: dict[str, int]) -> bool:
    """Whether `nodes` distinct hosts each have `gpus_per_node` free."""
    return sum(1 for n in free.values() if n >= gpus_per_node) >= nodes


def victim_order(candidates: Iterable[RunningJob], held: dict[int, int]) -> list[RunningJob]:
    """Lowest priority first, then the owner holding the most GPUs, then the most recently started."""
    return sorted(candidates, key=lambda r: (r.priority, -held.get(r.owner, 0), -r.started, -r.id))


def choose_victims(
    *,
    priority: int,
    nodes: int,
    gpus_per_node: int,
    free: dict[str, int],
    running: Sequence[RunningJob],
    held: dict[int, int],
) -> list[RunningJob] | None:
    """The jobs to preempt so that a job of `priority` needing `nodes` x `gpus_per_node` fits
    on the hosts of `free` (free GPUs per host it may use); None when none would make it fit
    (then nothing is preempted). `held`: GPUs each owner holds now."""
    useful = [
        r
        for r in running
        if r.preemptible and not r.stopping and r.priority < priority and any(h in free for h in r.slots)
    ]
    order = victim_order(useful, held)
    if not fits(nodes, gpus_per_node, _with(free, order)):
        return None
    tries = 0
    for size in range(1, len(order) + 1):
        for combo in combinations(order, size):
            tries += 1
            if fits(nodes, gpus_per_node, _with(free, combo)):
                return list(combo)
            if tries >= MAX_TRIES:
                return _greedy(nodes, gpus_per_node, free, order)
    return None  # (unreachable: all of them fit)


def _greedy(
    nodes: int, gpus_per_node: int, free: dict[str, int], order: list[RunningJob]
) -> list[RunningJob]:
    chosen: list[RunningJob] = []
    for victim in order:
        chosen.append(victim)
        if fits(nodes, gpus_per_node, _with(free, chosen)):
            break
    for victim in reversed(list(chosen)):  # the last in the order are the first spared
        rest = [c for c in chosen if c is not victim]
        if fits(nodes, gpus_per_node, _with(free, rest)):
            chosen = rest
    return chosen


def _with(free: dict[str, int], victims: Iterable[RunningJob]) -> dict[str, int]:
    """Free GPUs per usable host once `victims` are gone (their GPUs elsewhere do not help)."""
    out = dict(free)
    for victim in victims:
        for host, n in victim.slots.items():
            if host in out:
                out[host] += n
    return out
