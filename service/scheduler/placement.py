"""Gang placement as a pure function: jobs, free GPU slots and owners' usage in, placements out.

Policy: jobs go in order of priority (higher first); among equal priorities the next job is
the oldest of the owner who holds the fewest GPUs right now, counting what this pass has
already placed (fair share), then the oldest job (contract §9).
A job whose owner's `gpu_quota` it would exceed waits, and is never in anyone's way. A job is
placed only when every node fits at once, one node per distinct host, best fit first (the
host with the fewest free GPUs that still fit) so that big holes stay open for big jobs.
An elastic job (`max_nodes`) fits once its fewest nodes do, and takes as many as fit up to its
most. Smaller jobs may backfill around a job that does not fit, except once that job has waited
`starvation_s`: from then on nothing after it is placed until it is, so a stream of small
jobs cannot starve a large one forever.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from service.scheduler.preemption import RunningJob, choose_victims, fits

MAX_NAMED_HOSTS = 5  # a pending_reason names at most this many quarantined hosts, then counts


@dataclass(frozen=True, kw_only=True)
class Host:
    name: str
    free: tuple[int, ...]
    open_to_all: bool = True  # False: an unsandboxed worker, which takes the admin's jobs only
    multinode_open_to_all: bool = True  # False: the admin's multi-node jobs only (host network)
    meshes: bool = True  # a multi-node job's nodes get networks of their own (never mixed)
    quarantined: bool = False  # a sick host (contract §8): no new work until readmitted
    draining: bool = False  # an admin's drain (contract §12): no new work until readmitted
    cuda: bool = True  # a CUDA worker (False: `--accelerator cpu`, process slots)


@dataclass(frozen=True, kw_only=True)
class QueuedJob:
    id: int
    priority: int
    nodes: int
    gpus_per_node: int
    waited_s: float = 0.0
    by_admin: bool = True
    owner: int = 0
    sweep: int | None = None  # a sweep's child: its parent, whose max_parallel it counts in
    needs_cuda: bool = False  # e.g. amp fp16: never placed on a CPU worker of a mixed cluster
    max_nodes: int = 0  # an elastic job (contract §12): `nodes` is its fewest, this its most

    @property
    def most_nodes(self) -> int:
        """The most nodes it may run on: past 1, it may span hosts."""
        return max(self.nodes, self.max_nodes)


def node_count(job: QueuedJob, fitting: int, owner: Owner) -> int:
    """How many nodes to give a job that fits: its size, or for an elastic job as many as fit
    up to its most, within its owner's quota."""
    if job.max_nodes <= job.nodes:
        return job.nodes
    count = min(fitting, job.max_nodes)
    if owner.quota is not None:
        count = min(count, (owner.quota - owner.in_use) // job.gpus_per_node)
    return max(count, job.nodes)


@dataclass(kw_only=True)
class Owner:
    """A user's standing in this pass: GPUs held (grows as the pass places their jobs)."""

    name: str = ""
    in_use: int = 0
    quota: int | None = None


@dataclass
class SweepLimit:
    """A sweep's children holding GPUs in this pass (grows as it places them), and its
    `max_parallel` (contract §10)."""

    limit: int
    active: int = 0


@dataclass(frozen=True, kw_only=True)
class NodePlacement:
    node_rank: int
    host: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Plan:
    placements: dict[int, tuple[NodePlacement, ...]] = field(default_factory=dict)
    pending_reasons: dict[int, str] = field(default_factory=dict)
    # contract §12: queued job -> the running jobs it preempts (stopped; placed once they are)
    preemptions: dict[int, tuple[int, ...]] = field(default_factory=dict)


def queue_order(jobs: list[QueuedJob]) -> list[QueuedJob]:
    """Priority, then age: the order with every owner alike (no usage yet)."""
    return list(FairOrder(jobs, {}))


class FairOrder:
    """The jobs in placement order, decided one job at a time: after each placement the
    owner's `in_use` has grown, and the owner holding the fewest GPUs goes next."""

    def __init__(self, jobs: list[QueuedJob], owners: dict[int, Owner]) -> None:
        self.owners = owners
        self.levels: dict[int, dict[int, deque[QueuedJob]]] = {}
        for job in sorted(jobs, key=lambda j: j.id):
            self.levels.setdefault(job.priority, {}).setdefault(job.owner, deque()).append(job)

    def owner(self, owner_id: int) -> Owner:
        return self.owners.setdefault(owner_id, Owner())

    def _key(self, owner_id: int, head: QueuedJob) -> tuple[int, int, int]:
        o = self.owner(owner_id)
        return (o.in_use, head.id, owner_id)

    def __iter__(self) -> Iterator[QueuedJob]:
        for priority in sorted(self.levels, reverse=True):
            queues = self.levels[priority]
            heap = [self._key(o, q[0]) for o, q in queues.items()]
            heapq.heapify(heap)
            while heap:
                owner_id = heapq.heappop(heap)[-1]
                queue = queues[owner_id]
                yield queue.popleft()  # the caller may grow the owner's in_use meanwhile
                if queue:
                    heapq.heappush(heap, self._key(owner_id, queue[0]))


def plan(
    jobs: list[QueuedJob],
    hosts: list[Host],
    starvation_s: float,
    owners: dict[int, Owner] | None = None,
    sweeps: dict[int, SweepLimit] | None = None,
    running: Sequence[RunningJob] = (),
) -> Plan:
    free = {h.name: sorted(h.free) for h in hosts if not h.quarantined and not h.draining}
    sick = {h.name: len(h.free) for h in hosts if h.quarantined and not h.draining}
    preempting = Preempting(running)
    closed = {h.name for h in hosts if not h.open_to_all}
    host_networks = {h.name for h in hosts if not h.multinode_open_to_all}
    meshed = {h.name for h in hosts if h.meshes}
    cpu_only = {h.name for h in hosts if not h.cuda}
    result = Plan()
    blocker: QueuedJob | None = None
    order = FairOrder(jobs, {k: replace(o) for k, o in (owners or {}).items()})  # inputs stay as given
    limits = {k: replace(v) for k, v in (sweeps or {}).items()}
    for job in order:
        if blocker is not None:  # another user's job is named to no one but the admin (contract §7)
            named = blocker.owner == job.owner or job.by_admin
            whose = f"job {blocker.id}" if named else "another user's job"
            result.pending_reasons[job.id] = f"waiting behind {whose}, which has waited longest"
            continue
        owner, need = order.owner(job.owner), job.nodes * job.gpus_per_node
        sweep = limits.get(job.sweep) if job.sweep is not None else None
        if (held_back := _held_back(job, owner, need, sweep)) is not None:
            result.pending_reasons[job.id] = held_back
            continue
        barred = cpu_only if job.needs_cuda else set()
        fitting = _fitting(job, free, barred)
        shut = _shut_to(job, closed, host_networks)
        shut_out = Counter("unsandboxed" if n in closed else "host network" for n in fitting if n in shut)
        allowed = [n for n in fitting if n not in shut]
        fitting = one_network_kind(job, allowed, meshed)
        shut_out["other network"] = len(allowed) - len(fitting)
        if len(fitting) < job.nodes:
            if (why := preempting.make_room(job, free, shut, result, barred)) is not None:
                result.pending_reasons[job.id] = why
                continue
            quarantined = sorted(n for n, k in sick.items() if k >= job.gpus_per_node)
            result.pending_reasons[job.id] = _reason(job, len(fitting), shut_out, quarantined, bool(barred))
            if job.waited_s >= starvation_s:
                blocker = job
            continue
        nodes, count = [], node_count(job, len(fitting), owner)
        need = count * job.gpus_per_node
        for rank, host in enumerate(fitting[:count]):
            taken, free[host] = tuple(free[host][: job.gpus_per_node]), free[host][job.gpus_per_node :]
            nodes.append(NodePlacement(node_rank=rank, host=host, gpus=taken))
        result.placements[job.id] = tuple(nodes)
        owner.in_use += need
        if sweep is not None:
            sweep.active += 1
    return result


class Preempting:
    """Preemption within one pass (contract §12): the running jobs, who holds how many GPUs,
    what is being freed for whom, and the victims this pass has chosen already."""

    def __init__(self, running: Sequence[RunningJob]) -> None:
        self.running = list(running)
        self.held: dict[int, int] = {}
        self.coming: dict[int, dict[str, int]] = {}  # preemptor -> GPUs per host being freed for it
        for r in self.running:
            self.held[r.owner] = self.held.get(r.owner, 0) + sum(r.slots.values())
            if r.for_job is not None:
                into = self.coming.setdefault(r.for_job, {})
                for host, n in r.slots.items():
                    into[host] = into.get(host, 0) + n
        self.taken: set[int] = set()

    def make_room(
        self,
        job: QueuedJob,
        free: dict[str, list[int]],
        closed: set[str],
        result: Plan,
        barred: set[str] | frozenset[str] = frozenset(),
    ) -> str | None:
        """For a job that does not fit: wait for the jobs preempted for it already when their
        GPUs will make it fit, else preempt (once: the victims are marked stopping). Either way
        the free GPUs it will take are held back from the jobs after it. None: no room to make."""
        if not self.running:
            return None
        usable = {n: len(g) for n, g in free.items() if (job.by_admin or n not in closed) and n not in barred}
        coming = self.coming.get(job.id, {})
        soon = {n: k + coming.get(n, 0) for n, k in usable.items()}
        if coming and fits(job.nodes, job.gpus_per_node, soon):
            self._hold(job, free, soon)
            return "preempted lower-priority jobs for its GPUs; starts once they have stopped"
        candidates = [r for r in self.running if r.id not in self.taken]
        victims = choose_victims(
            priority=job.priority,
            nodes=job.nodes,
            gpus_per_node=job.gpus_per_node,
            free=soon,
            running=candidates,
            held=self.held,
        )
        if not victims:
            return None
        self.taken.update(v.id for v in victims)
        result.preemptions[job.id] = tuple(v.id for v in victims)
        for victim in victims:
            for host, n in victim.slots.items():
                if host in soon:
                    soon[host] += n
        self._hold(job, free, soon)
        word = "job" if len(victims) == 1 else "jobs"
        return f"preempting {len(victims)} lower-priority {word} for its GPUs; starts once they have stopped"

    @staticmethod
    def _hold(job: QueuedJob, free: dict[str, list[int]], soon: dict[str, int]) -> None:
        """Take from `free` the GPUs the job will use next to those being freed for it."""
        hosts = sorted((n for n, k in soon.items() if k >= job.gpus_per_node), key=lambda n: (soon[n], n))
        for host in hosts[: job.nodes]:
            freed_here = soon[host] - len(free[host])
            free[host] = free[host][max(0, job.gpus_per_node - freed_here) :]


def _held_back(job: QueuedJob, owner: Owner, need: int, sweep: SweepLimit | None) -> str | None:
    """Over its owner's quota (then it preempts nothing either), or its sweep's max_parallel."""
    if owner.quota is not None and owner.in_use + need > owner.quota:
        return _over_quota(owner, need)
    if sweep is not None and sweep.active >= sweep.limit:
        return (
            f"waits for its sweep's max_parallel: {sweep.active} of {sweep.limit} children of "
            f"sweep {job.sweep} hold GPUs"
        )
    return None


def _over_quota(owner: Owner, need: int) -> str:
    who = owner.name or "its owner"
    return (
        f"waits for its owner's gpu_quota: {who} holds {owner.in_use} of {owner.quota} GPUs "
        f"and this job needs {need}"
    )


def _fitting(job: QueuedJob, free: dict[str, list[int]], barred: set[str]) -> list[str]:
    """The hosts with room for one node of the job, best fit first (fewest free GPUs)."""
    return sorted(
        (n for n, gpus in free.items() if len(gpus) >= job.gpus_per_node and n not in barred),
        key=lambda n: (len(free[n]), n),
    )


def one_network_kind(job: QueuedJob, fitting: list[str], meshed: set[str]) -> list[str]:
    """For a job that may run on several nodes, the fitting hosts of one kind only: all give
    its nodes networks of their own, or none do. A node in a network of its own meets its
    peers at their own addresses, which a node on its host's network never says: mixed, the
    job would wait out its rendezvous and fail. The kind that gives it more nodes (up to its
    most), meshed hosts where both give as many."""
    most = job.most_nodes
    if most <= 1:
        return fitting
    own = [n for n in fitting if n in meshed]
    plain = [n for n in fitting if n not in meshed]
    return own if min(len(own), most) >= min(len(plain), most) else plain


def _shut_to(job: QueuedJob, closed: set[str], host_networks: set[str]) -> set[str]:
    """The hosts that take none of this job: for another user's, those without a sandbox; and
    for a job that may run on several nodes, those whose multi-node jobs keep the host's
    network (contract §7 v3: its ranks would reach the host's services)."""
    if job.by_admin:
        return set()
    return closed | host_networks if job.most_nodes > 1 else closed


def _reason(
    job: QueuedJob,
    fitting: int,
    shut_out: Counter[str] | None = None,
    quarantined: list[str] | None = None,
    cuda_only: bool = False,
) -> str:
    hosts = "1 has them" if fitting == 1 else f"{fitting} have them"
    node_word = "node" if job.nodes == 1 else "nodes"
    reason = f"needs {job.nodes} {node_word} with {job.gpus_per_node} free GPUs; {hosts}"
    if cuda_only:
        reason += " (it needs a CUDA worker: amp fp16)"
    shut_out = shut_out or Counter()
    if shut_out["unsandboxed"]:
        reason += f" ({shut_out['unsandboxed']} more without a sandbox take only the admin's jobs)"
    if shut_out["host network"]:
        reason += (
            f" ({shut_out['host network']} more run multi-node jobs on their host's network"
            " and take only the admin's)"
        )
    if shut_out["other network"]:
        reason += (
            f" ({shut_out['other network']} more would put its nodes in another kind of network:"
            " a job's nodes all get networks of their own, or none)"
        )
    if quarantined:
        names = ", ".join(quarantined[:MAX_NAMED_HOSTS])
        if len(quarantined) > MAX_NAMED_HOSTS:
            names += f" and {len(quarantined) - MAX_NAMED_HOSTS} more"
        reason += f"; quarantined, and would fit: {names} (an admin's POST /v1/workers/NAME/readmit)"
    return reason
