"""Gang placement as a pure function: jobs and free GPU slots in, placements out.

Policy: jobs go in order of priority (higher first), then age. A job is placed only when
every node fits at once, one node per distinct host, best fit first (the host with the
fewest free GPUs that still fit) so that big holes stay open for big jobs. Smaller jobs may
backfill around a job that does not fit, except once that job has waited `starvation_s`:
from then on nothing behind it is placed until it is, so a stream of small jobs cannot
starve a large one forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Host:
    name: str
    free: tuple[int, ...]
    open_to_all: bool = True  # False: an unsandboxed worker, which takes the admin's jobs only


@dataclass(frozen=True, kw_only=True)
class QueuedJob:
    id: int
    priority: int
    nodes: int
    gpus_per_node: int
    waited_s: float = 0.0
    by_admin: bool = True


@dataclass(frozen=True, kw_only=True)
class NodePlacement:
    node_rank: int
    host: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Plan:
    placements: dict[int, tuple[NodePlacement, ...]] = field(default_factory=dict)
    pending_reasons: dict[int, str] = field(default_factory=dict)


def queue_order(jobs: list[QueuedJob]) -> list[QueuedJob]:
    return sorted(jobs, key=lambda j: (-j.priority, j.id))


def plan(jobs: list[QueuedJob], hosts: list[Host], starvation_s: float) -> Plan:
    free = {h.name: sorted(h.free) for h in hosts}
    closed = {h.name for h in hosts if not h.open_to_all}
    result = Plan()
    blocker: QueuedJob | None = None
    for job in queue_order(jobs):
        if blocker is not None:
            result.pending_reasons[job.id] = f"waiting behind job {blocker.id}, which has waited longest"
            continue
        fitting = sorted(
            (n for n, gpus in free.items() if len(gpus) >= job.gpus_per_node), key=lambda n: (len(free[n]), n)
        )
        unsandboxed = 0
        if not job.by_admin:
            unsandboxed = sum(1 for n in fitting if n in closed)
            fitting = [n for n in fitting if n not in closed]
        if len(fitting) < job.nodes:
            result.pending_reasons[job.id] = _reason(job, len(fitting), unsandboxed)
            if job.waited_s >= starvation_s:
                blocker = job
            continue
        nodes = []
        for rank, host in enumerate(fitting[: job.nodes]):
            taken, free[host] = tuple(free[host][: job.gpus_per_node]), free[host][job.gpus_per_node :]
            nodes.append(NodePlacement(node_rank=rank, host=host, gpus=taken))
        result.placements[job.id] = tuple(nodes)
    return result


def _reason(job: QueuedJob, fitting: int, unsandboxed: int = 0) -> str:
    hosts = "1 has them" if fitting == 1 else f"{fitting} have them"
    node_word = "node" if job.nodes == 1 else "nodes"
    reason = f"needs {job.nodes} {node_word} with {job.gpus_per_node} free GPUs; {hosts}"
    if unsandboxed:
        reason += f" ({unsandboxed} more without a sandbox take only the admin's jobs)"
    return reason
