"""The scheduler pass: reap lost workers, place queued jobs, then dispatch — in that order.

One pass is one transaction; Celery messages go out only after it commits, so a worker never
receives a node for a row that does not exist yet. Two schedulers (two API replicas) are
safe: on PostgreSQL a transaction-scoped advisory lock lets one pass run at a time, queued
rows are locked with SKIP LOCKED, and on every database the GPU-slot primary key makes a
double allocation impossible — a pass that loses a race rolls back and the next one retries.

The reaper is `service.scheduler.reaper`; the thread that runs passes, `service.scheduler.thread`.
The pass reads and writes through the repositories, but for its two locks, kept here where
they are taken: the advisory lock (`run_pass`) and the queue's SKIP LOCKED read
(`placement_inputs`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Row, select, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from service.config import Settings
from service.db import Database
from service.hosts import repository as hosts_repo
from service.jobs import elastic
from service.jobs import repository as jobs_repo
from service.jobs.dependencies import Readiness, fail_doomed, readiness, take_dependency_checkpoint
from service.jobs.lifecycle import open_attempt
from service.jobs.preemption import WAITS
from service.jobs.states import QUEUED, SCHEDULED, lock_job, transition_job
from service.jobs.sweeps import settle_sweeps, sweep_limits
from service.models import GpuAllocation, Job, NodeRun, User, Worker, utcnow
from service.scheduler.outages import DatabaseOutages
from service.scheduler.placement import Host, NodePlacement, Owner, QueuedJob, SweepLimit, plan
from service.scheduler.preemption import RunningJob
from service.scheduler.reaper import clean_lost_parts, reap
from service.scheduler.resizes import grow
from service.scheduler.stops import drain, preempt, running_jobs
from service.usage.repository import gpus_in_use
from service.users import repository as users_repo

log = logging.getLogger("torchjobs.scheduler")
ADVISORY_KEY = 0x746A6F6273  # "tjobs"
MAX_PENDING_REASON = 512  # the column's length (PostgreSQL refuses a longer value)


@dataclass(frozen=True, kw_only=True)
class Dispatch:
    job_id: int
    attempt: int
    node_rank: int
    worker: str


Dispatcher = Callable[[list[Dispatch]], None]


@dataclass
class Room:
    """Whether the last pass left a GPU slot free: only then can a job submitted since be
    placed before the next timed pass, so only then is a submit worth a pass of its own."""

    gpu_free: bool = True


def run_pass(
    db: Database,
    settings: Settings,
    dispatch: Dispatcher,
    throttle: ResendThrottle | None = None,
    outages: DatabaseOutages | None = None,
    room: Room | None = None,
) -> list[Dispatch]:
    try:
        with db.transaction() as session:
            locked = (
                not db.is_postgres
                or session.execute(
                    text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": ADVISORY_KEY}
                ).scalar_one()
            )
            if outages is not None:
                outages.reached()  # (on SQLite, not yet: a failure below says otherwise)
            if not locked:
                return []
            lost = reap(session, settings, judge_silence=outages is None or outages.may_judge_silence())
            drain(session)
            grow(session, settings)
            sent = place(session, settings, room)
            resend = throttle.due(undelivered(session, settings)) if throttle else []
    except (IntegrityError, OperationalError) as exc:
        log.warning("scheduler pass rolled back: %s", exc.__class__.__name__)
        if outages is not None and isinstance(exc, OperationalError):
            outages.unreachable()
        return []
    settle(db)
    clean_lost_parts(db, settings, lost)
    if sent or resend:
        try:
            dispatch(sent + resend)
        except Exception as exc:  # broker down: the rows stand, undelivered() sends again later
            log.warning("dispatch failed (%s); nodes will be re-sent", exc.__class__.__name__)
    return sent


def settle(db: Database) -> None:
    """Sweep parents follow their children (contract §10), in a transaction of their own: it
    locks parents, and the pass above locks children (`service.jobs.sweeps`, lock order)."""
    try:
        with db.read() as session:  # no sweep alive: no write transaction (SQLite's lock)
            if not jobs_repo.any_live_sweep(session):
                return
        with db.transaction() as session:
            settle_sweeps(session)
    except (IntegrityError, OperationalError) as exc:
        log.warning("sweep bookkeeping rolled back: %s", exc.__class__.__name__)


def undelivered(session: Session, settings: Settings) -> list[Dispatch]:
    """Nodes placed a while ago that no worker has claimed yet.

    Celery only delivers; the node row is the truth. A message lost with a broker restart or
    a failed send is sent again, and a duplicate finds the node claimed and does nothing.
    """
    cutoff = utcnow() - timedelta(seconds=settings.redispatch_after_s)
    runs = jobs_repo.pending_runs_before(session, cutoff)
    return [
        Dispatch(job_id=r.job_id, attempt=r.attempt, node_rank=r.node_rank, worker=r.worker_name)
        for r in runs
    ]


class ResendThrottle:
    """Sends a given node's message again at most once per interval."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.last: dict[Dispatch, float] = {}

    def due(self, items: list[Dispatch]) -> list[Dispatch]:
        now = time.monotonic()
        self.last = {k: t for k, t in self.last.items() if now - t < 10 * self.interval_s}
        fresh = [i for i in items if now - self.last.get(i, -1e18) >= self.interval_s]
        for item in fresh:
            self.last[item] = now
        return fresh


@dataclass(frozen=True)
class PlacementInputs:
    """What one pass plans over: the queue's few columns, and the online hosts' free slots."""

    rows: Sequence[Row[Any]] | Sequence[Any]
    queued: list[QueuedJob]
    hosts: list[Host]
    workers: dict[str, Worker]
    owners: dict[int, Owner] = field(default_factory=dict)
    readiness: Readiness = field(default_factory=Readiness)  # jobs waiting on jobs, or doomed by them
    sweeps: dict[int, SweepLimit] = field(default_factory=dict)  # max_parallel of the queue's sweeps
    running: list[RunningJob] = field(default_factory=list)  # what preemption may stop (contract §12)


def placement_inputs(session: Session) -> PlacementInputs:
    """Queued rows are locked (SKIP LOCKED on PostgreSQL): another scheduler plans around them."""
    query = (
        select(
            Job.id,
            Job.priority,
            Job.nodes,
            Job.nodes_min,
            Job.nodes_max,
            Job.gpus_per_node,
            Job.queued_at,
            Job.pending_reason,
            Job.owner_id,
            Job.parent_id,
            # what only a CUDA worker can run: fp16 autocast (its GradScaler has no CPU form);
            # on a CPU worker of a mixed cluster it would fail at its first step. One field,
            # not the whole JSON of every queued job.
            Job.hyperparameters["amp"].as_string().label("amp"),
            User.is_admin,
        )
        .join(User, User.id == Job.owner_id)
        .where(Job.state == QUEUED)
        .order_by(Job.priority.desc(), Job.id)
        .limit(5000)
    )
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True, of=Job)
    rows = session.execute(query).all()
    if not rows:
        return PlacementInputs(rows, [], [], {})
    workers = {w.name: w for w in hosts_repo.online_workers(session)}
    used = hosts_repo.used_slots(session)
    hosts = [
        Host(
            name=n,
            free=tuple(i for i in range(w.gpus) if i not in used.get(n, set())),
            open_to_all=w.open_to_all,
            multinode_open_to_all=w.multinode_open_to_all,
            meshes=w.meshes,
            quarantined=w.quarantine_reason is not None,
            draining=w.draining_since is not None,
            cuda=w.accelerator == "cuda",
        )
        for n, w in workers.items()
    ]
    now = utcnow()
    ready = readiness(session, [r.id for r in rows])
    held_back = ready.waiting.keys() | ready.doomed.keys()
    queued = [
        QueuedJob(
            id=r.id,
            priority=r.priority,
            nodes=r.nodes_min or r.nodes,
            max_nodes=r.nodes_max or 0,
            gpus_per_node=r.gpus_per_node,
            waited_s=(now - r.queued_at).total_seconds(),
            by_admin=bool(r.is_admin),
            owner=r.owner_id,
            sweep=r.parent_id,
            needs_cuda=r.amp == "fp16",
        )
        for r in rows
        if r.id not in held_back
    ]
    owners = owners_of(session, {r.owner_id for r in rows})
    sweeps = sweep_limits(session, {q.sweep for q in queued if q.sweep is not None})
    running = running_jobs(session, max((q.priority for q in queued), default=None))
    return PlacementInputs(rows, queued, hosts, workers, owners, ready, sweeps, running)


def owners_of(session: Session, owner_ids: set[int]) -> dict[int, Owner]:
    """What fair share and quotas plan with (contract §9): the GPUs each owner holds now (their
    jobs' allocation rows, read in the pass's own transaction, so a quota holds even against
    a pass that placed a moment ago) and their quota."""
    held = gpus_in_use(session, owner_ids)
    users = users_repo.quotas(session, owner_ids)
    return {u.id: Owner(name=u.name, in_use=held.get(u.id, 0), quota=u.gpu_quota) for u in users}


def place(session: Session, settings: Settings, room: Room | None = None) -> list[Dispatch]:
    """Plan over the queue's few columns; load and lock whole rows only for the jobs placed."""
    inputs = placement_inputs(session)
    if room is not None:
        room.gpu_free = True  # an empty queue: the hosts were not read
    if not inputs.rows:
        return []
    rows, queued, hosts, workers = inputs.rows, inputs.queued, inputs.hosts, inputs.workers
    decision = plan(queued, hosts, settings.starvation_s, inputs.owners, inputs.sweeps, inputs.running)
    if room is not None:
        room.gpu_free = _any_left_free(hosts, decision.placements)
    _write_pending_reasons(session, rows, decision.pending_reasons, bool(workers))
    _write_pending_reasons(session, rows, inputs.readiness.waiting, any_worker=True)
    fail_doomed(session, inputs.readiness.doomed)
    preempt(session, decision.preemptions)
    sent: list[Dispatch] = []
    busy_ports = _ports_in_use(session)
    for job_id, nodes in decision.placements.items():
        job = lock_job(session, job_id)
        if job is None or job.state != QUEUED:
            continue
        if (why := take_dependency_checkpoint(session, job)) is not None:
            fail_doomed(session, {job.id: why})
            continue
        job.master_port = _pick_port(settings, busy_ports.setdefault(nodes[0].host, set()))
        job.pending_reason = None
        elastic.placed(session, job, len(nodes))
        open_attempt(session, job)
        for node in nodes:
            hosts_repo.add_allocations(
                session, (GpuAllocation(worker_name=node.host, gpu_index=g, job_id=job.id) for g in node.gpus)
            )
            jobs_repo.add_node_run(
                session,
                NodeRun(
                    job_id=job.id,
                    attempt=job.attempt,
                    node_rank=node.node_rank,
                    worker_name=node.host,
                    gpus=list(node.gpus),
                    address=workers[node.host].address,
                ),
            )
            sent.append(
                Dispatch(job_id=job.id, attempt=job.attempt, node_rank=node.node_rank, worker=node.host)
            )
        session.flush()
        hosts_desc = ", ".join(f"{n.host}{list(n.gpus)}" for n in nodes)
        transition_job(session, job, SCHEDULED, f"placed on {hosts_desc}")
    return sent


def _any_left_free(hosts: Sequence[Host], placements: dict[int, tuple[NodePlacement, ...]]) -> bool:
    taken: dict[str, int] = {}
    for nodes in placements.values():
        for node in nodes:
            taken[node.host] = taken.get(node.host, 0) + len(node.gpus)
    return any(len(h.free) > taken.get(h.name, 0) for h in hosts if not h.quarantined)


def _write_pending_reasons(session: Session, rows: Any, reasons: dict[int, str], any_worker: bool) -> None:
    """Only the reasons that changed are written: a long, stuck queue costs no writes."""
    current = {r.id: r.pending_reason for r in rows}
    changed = []
    for job_id, reason in reasons.items():
        reason = reason if any_worker else "no worker is online"
        if (current.get(job_id) or "").startswith(WAITS) and not reason.startswith(WAITS):
            reason = WAITS + reason  # it was preempted (contract §12), and says so until placed
        reason = reason[:MAX_PENDING_REASON]
        if current.get(job_id) != reason:
            changed.append({"id": job_id, "pending_reason": reason})
    if changed:
        jobs_repo.set_pending_reasons(session, changed)


def _ports_in_use(session: Session) -> dict[str, set[int]]:
    busy: dict[str, set[int]] = {}
    for worker, port in jobs_repo.master_ports(session):
        if port is not None:  # (the query asks for none)
            busy.setdefault(worker, set()).add(port)
    return busy


def _pick_port(settings: Settings, busy: set[int]) -> int:
    """Random in the configured span, avoiding ports of this host's live jobs (and recent ones)."""
    base, span = settings.master_port_base, settings.master_port_span
    for _ in range(span):
        port = base + random.randrange(span)
        if port not in busy:
            busy.add(port)
            return port
    raise RuntimeError("no free rendezvous port")


__all__ = ["SCHEDULED", "Dispatch", "place", "run_pass"]
