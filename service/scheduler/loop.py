"""The scheduler pass: reap lost workers, place queued jobs, then dispatch — in that order.

One pass is one transaction; Celery messages go out only after it commits, so a worker never
receives a node for a row that does not exist yet. Two schedulers (two API replicas) are
safe: on PostgreSQL a transaction-scoped advisory lock lets one pass run at a time, queued
rows are locked with SKIP LOCKED, and on every database the GPU-slot primary key makes a
double allocation impossible — a pass that loses a race rolls back and the next one retries.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Row, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from service.config import Settings
from service.db import Database
from service.hosts import repository as hosts_repo
from service.hosts.health import HostVerdict, record_node_end
from service.hosts.states import take_offline
from service.jobs.dependencies import Readiness, fail_doomed, readiness, take_dependency_checkpoint
from service.jobs.lifecycle import cancel_pending_nodes, lose_node, open_attempt, runs_of, tell_quarantined
from service.jobs.states import ACTIVE, CANCELLING, QUEUED, SCHEDULED, lock_job, transition_job
from service.jobs.sweeps import SWEEP, settle_sweeps, sweep_limits
from service.models import GpuAllocation, Job, NodeRun, User, Worker, utcnow
from service.scheduler.outages import DatabaseOutages
from service.scheduler.placement import Host, NodePlacement, Owner, QueuedJob, SweepLimit, plan
from service.states import NODE_ACTIVE, JobState, NodeState, WorkerState
from service.usage.accounting import gpus_in_use

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
            reap(session, settings, judge_silence=outages is None or outages.may_judge_silence())
            sent = place(session, settings, room)
            resend = throttle.due(undelivered(session, settings)) if throttle else []
    except (IntegrityError, OperationalError) as exc:
        log.warning("scheduler pass rolled back: %s", exc.__class__.__name__)
        if outages is not None and isinstance(exc, OperationalError):
            outages.unreachable()
        return []
    settle(db)
    if sent or resend:
        try:
            dispatch(sent + resend)
        except Exception as exc:  # broker down: the rows stand, undelivered() sends again later
            log.warning("dispatch failed (%s); nodes will be re-sent", exc.__class__.__name__)
    return sent


_LIVE_SWEEP = select(Job.id).where(Job.kind == SWEEP, Job.state.in_((JobState.RUNNING, CANCELLING))).limit(1)


def settle(db: Database) -> None:
    """Sweep parents follow their children (contract §10), in a transaction of their own: it
    locks parents, and the pass above locks children (`service.jobs.sweeps`, lock order)."""
    try:
        with db.read() as session:  # no sweep alive: no write transaction (SQLite's lock)
            if not session.execute(_LIVE_SWEEP).first():
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
    runs = session.execute(
        select(NodeRun).where(NodeRun.state == NodeState.PENDING, NodeRun.created_at < cutoff)
    ).scalars()
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


_HOST_SESSIONS = select(Worker.name, Worker.state, Worker.session)
_ACTIVE_RUNS = select(
    NodeRun.id,
    NodeRun.worker_name,
    NodeRun.state,
    NodeRun.worker_session,
    NodeRun.created_at,
    NodeRun.node_rank,
).where(NodeRun.state.in_(NODE_ACTIVE))


def reap(session: Session, settings: Settings, judge_silence: bool = True) -> None:
    """Workers silent past the timeout go offline; their nodes are lost; their jobs retry or fail.

    Not `judge_silence`: the database was away a moment ago (`DatabaseOutages`), so nobody is
    taken offline, and no node is late, for a silence that was the database's own."""
    now = utcnow()
    cutoff = now - timedelta(seconds=settings.heartbeat_timeout_s)
    for worker in hosts_repo.stale_online(session, cutoff) if judge_silence else ():
        if take_offline(worker):
            log.warning("worker %s missed its heartbeats: offline", worker.name)
    # Three columns of each host and five of each active node, not whole rows: with a thousand
    # hosts this pass runs every second (bench/scale.py); rows are loaded for the lost only.
    sessions = {name: (state, current) for name, state, current in session.execute(_HOST_SESSIONS)}
    lost: dict[int, str] = {}
    for run_id, worker_name, state, worker_session, created_at, node_rank in session.execute(_ACTIVE_RUNS):
        host_state, current = sessions.get(worker_name, (WorkerState.OFFLINE, None))
        gone = host_state == WorkerState.OFFLINE or (state == NodeState.RUNNING and worker_session != current)
        late = (
            judge_silence
            and state == NodeState.PENDING
            and (now - created_at).total_seconds() > settings.rendezvous_timeout_s
        )
        if gone or late:
            lost[run_id] = "worker lost" if gone else f"node {node_rank} did not start in time"
    runs = session.execute(select(NodeRun).where(NodeRun.id.in_(list(lost)))).scalars().all() if lost else []
    for run in runs:
        reason = lost[run.id]
        if lose_node(session, run, reason) and record_node_end(
            session, run.worker_name, HostVerdict.FAILED_HERE, reason, settings.quarantine_after
        ):
            tell_quarantined(session, run.job_id, run.worker_name)
    cancelling = select(Job).where(Job.state == CANCELLING, Job.kind != SWEEP)  # (a sweep: settle_sweeps)
    for job in session.execute(cancelling).scalars().all():
        if all(r.state != NodeState.RUNNING for r in runs_of(session, job.id, job.attempt)):
            cancel_pending_nodes(session, job)


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


def placement_inputs(session: Session) -> PlacementInputs:
    """Queued rows are locked (SKIP LOCKED on PostgreSQL): another scheduler plans around them."""
    query = (
        select(
            Job.id,
            Job.priority,
            Job.nodes,
            Job.gpus_per_node,
            Job.queued_at,
            Job.pending_reason,
            Job.owner_id,
            Job.parent_id,
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
    online = select(Worker).where(Worker.state == WorkerState.ONLINE)
    workers = {w.name: w for w in session.execute(online).scalars()}
    used = hosts_repo.used_slots(session)
    hosts = [
        Host(
            name=n,
            free=tuple(i for i in range(w.gpus) if i not in used.get(n, set())),
            open_to_all=w.open_to_all,
            quarantined=w.quarantine_reason is not None,
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
            nodes=r.nodes,
            gpus_per_node=r.gpus_per_node,
            waited_s=(now - r.queued_at).total_seconds(),
            by_admin=bool(r.is_admin),
            owner=r.owner_id,
            sweep=r.parent_id,
        )
        for r in rows
        if r.id not in held_back
    ]
    owners = owners_of(session, {r.owner_id for r in rows})
    sweeps = sweep_limits(session, {q.sweep for q in queued if q.sweep is not None})
    return PlacementInputs(rows, queued, hosts, workers, owners, ready, sweeps)


def owners_of(session: Session, owner_ids: set[int]) -> dict[int, Owner]:
    """What fair share and quotas plan with (contract §9): the GPUs each owner holds now (their
    jobs' allocation rows, read in the pass's own transaction, so a quota holds even against
    a pass that placed a moment ago) and their quota."""
    held = gpus_in_use(session, owner_ids)
    users = session.execute(select(User.id, User.name, User.gpu_quota).where(User.id.in_(owner_ids)))
    return {u.id: Owner(name=u.name, in_use=held.get(u.id, 0), quota=u.gpu_quota) for u in users}


def place(session: Session, settings: Settings, room: Room | None = None) -> list[Dispatch]:
    """Plan over the queue's few columns; load and lock whole rows only for the jobs placed."""
    inputs = placement_inputs(session)
    if room is not None:
        room.gpu_free = True  # an empty queue: the hosts were not read
    if not inputs.rows:
        return []
    rows, queued, hosts, workers = inputs.rows, inputs.queued, inputs.hosts, inputs.workers
    decision = plan(queued, hosts, settings.starvation_s, inputs.owners, inputs.sweeps)
    if room is not None:
        room.gpu_free = _any_left_free(hosts, decision.placements)
    _write_pending_reasons(session, rows, decision.pending_reasons, bool(workers))
    _write_pending_reasons(session, rows, inputs.readiness.waiting, any_worker=True)
    fail_doomed(session, inputs.readiness.doomed)
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
        open_attempt(session, job)
        for node in nodes:
            session.add_all(
                GpuAllocation(worker_name=node.host, gpu_index=g, job_id=job.id) for g in node.gpus
            )
            session.add(
                NodeRun(
                    job_id=job.id,
                    attempt=job.attempt,
                    node_rank=node.node_rank,
                    worker_name=node.host,
                    gpus=list(node.gpus),
                    address=workers[node.host].address,
                )
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
        reason = (reason if any_worker else "no worker is online")[:MAX_PENDING_REASON]
        if current.get(job_id) != reason:
            changed.append({"id": job_id, "pending_reason": reason})
    if changed:
        session.execute(update(Job), changed)


def _ports_in_use(session: Session) -> dict[str, set[int]]:
    rows = session.execute(
        select(NodeRun.worker_name, Job.master_port)
        .join(Job, (Job.id == NodeRun.job_id) & (Job.attempt == NodeRun.attempt))
        .where(Job.state.in_(ACTIVE), NodeRun.node_rank == 0, Job.master_port.is_not(None))
    ).all()
    busy: dict[str, set[int]] = {}
    for worker, port in rows:
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


REST_PER_PASS = 2.0
MAX_REST_S = 1.0


class SchedulerThread(threading.Thread):
    """Runs passes every `scheduler_interval_s`, or at once when `wake()` is called."""

    def __init__(self, db: Database, settings: Settings, dispatch: Dispatcher) -> None:
        super().__init__(name="torchjobs-scheduler", daemon=True)
        self.db, self.settings, self.dispatch = db, settings, dispatch
        self.throttle = ResendThrottle(settings.redispatch_after_s)
        self.outages = DatabaseOutages(settings.heartbeat_timeout_s)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.room = Room()
        self.observe_pass: Callable[[float], None] = lambda _seconds: None  # the app's histogram

    def wake(self) -> None:
        self._wake.set()

    def wake_for_submit(self) -> None:
        """A pass now for a new job, unless the last one left no GPU free: against a full
        cluster a flood of submits would each buy a pass over the whole queue that places
        nothing (measured: a fifth of the server's CPU per `POST /v1/jobs` with 3,000 jobs
        queued). The timed pass, `scheduler_interval_s` later, gives the job its reason; a
        freed GPU, a new host or a cancel wakes the scheduler as before."""
        if self.room.gpu_free:
            self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        while not self._stopping.is_set():
            pause = self.settings.scheduler_interval_s
            took = 0.0
            try:
                started = time.perf_counter()
                run_pass(self.db, self.settings, self.dispatch, self.throttle, self.outages, self.room)
                took = time.perf_counter() - started
                self.observe_pass(took)
                if not has_waiting_work(self.db):
                    pause = max(pause, self.settings.scheduler_idle_interval_s)
            except OperationalError as exc:  # the database away (has_waiting_work; run_pass catches its own)
                self.outages.unreachable()
                log.warning("scheduler: database unreachable (%s)", exc.__class__.__name__)
            except Exception:  # keep scheduling whatever one pass hit
                log.exception("scheduler pass failed")
            # Rest twice as long as the pass took before a wake may start the next: a stream
            # of submits against a long queue (each one a wake, each pass reading the whole
            # queue) then costs at most a third of the process's CPU, not all of it, and a
            # short queue's pass (milliseconds) is as prompt as before.
            self._stopping.wait(min(REST_PER_PASS * took, MAX_REST_S))
            self._wake.wait(pause)
            self._wake.clear()


def has_waiting_work(db: Database) -> bool:
    """Whether the next timed pass may have something to do besides noticing a lost worker: a
    job queued (capacity may free), cancelling (its pending nodes to close), or a node placed
    and not yet claimed (to re-send). A submit or freed GPUs wake the scheduler anyway."""
    with db.read() as session:
        job = session.execute(select(Job.id).where(Job.state.in_((QUEUED, CANCELLING))).limit(1)).first()
        if job is None:  # a sweep whose children all ended since the last pass: settle it
            live = select(Job.id).where(Job.kind == SWEEP, Job.state == JobState.RUNNING).limit(1)
            job = session.execute(live).first()
        node = session.execute(select(NodeRun.id).where(NodeRun.state == NodeState.PENDING).limit(1)).first()
    return job is not None or node is not None


__all__ = ["SCHEDULED", "Dispatch", "SchedulerThread", "place", "reap", "run_pass"]
