"""All SQL about worker hosts and their GPU slots, but the writers of `Worker.state`
(`service.hosts.states`, the gate)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import Integer, Row, bindparam, func, select, update
from sqlalchemy.orm import Session

from service.models import DataVersion, GpuAllocation, HostSubnet, Job, NodeRun, Worker
from service.states import JobState, WorkerState


def all_workers(session: Session) -> Sequence[Worker]:
    return session.execute(select(Worker).order_by(Worker.name)).scalars().all()


def allocations(session: Session) -> Sequence[GpuAllocation]:
    return session.execute(select(GpuAllocation)).scalars().all()


def jobs_owned_by(session: Session, owner_id: int, job_ids: set[int]) -> set[int]:
    if not job_ids:
        return set()
    query = select(Job.id).where(Job.owner_id == owner_id, Job.id.in_(job_ids))
    return set(session.execute(query).scalars())


def used_slots(session: Session, allocs: Sequence[GpuAllocation] | None = None) -> dict[str, set[int]]:
    """GPU indices held on each worker, from the allocation rows (read here unless given)."""
    used: dict[str, set[int]] = {}
    for alloc in allocations(session) if allocs is None else allocs:
        used.setdefault(alloc.worker_name, set()).add(alloc.gpu_index)
    return used


def stale_online(session: Session, before: datetime) -> Sequence[Worker]:
    return (
        session.execute(
            select(Worker).where(Worker.state == WorkerState.ONLINE, Worker.last_heartbeat < before)
        )
        .scalars()
        .all()
    )


def worker(session: Session, name: str) -> Worker | None:
    """By primary key: the session's own copy when it holds one already (then no query)."""
    return session.get(Worker, name)


def lock_worker(session: Session, name: str) -> Worker | None:
    """The host's row under a row lock (SQLite: the BEGIN IMMEDIATE lock already serialises)."""
    return session.get(Worker, name, with_for_update=True)


def reset_failures(session: Session, name: str) -> None:
    """The host's failures in a row start over (written only when there are some)."""
    session.execute(
        update(Worker)
        .where(Worker.name == name, Worker.infra_failures != 0)
        .values(infra_failures=0, job_failures=0, job_failure_owners=None)
    )


def set_exec_endpoint(session: Session, name: str, session_id: str, address: str, secret: str) -> None:
    """The worker process's exec endpoint and secret on its row, only while the row is still that
    process's (`session_id`): a restarted worker's row is not overwritten by its predecessor."""
    session.execute(
        update(Worker)
        .where(Worker.name == name, Worker.session == session_id)
        .values(exec_address=address, exec_secret=secret)
    )


def online_workers(session: Session) -> Sequence[Worker]:
    return session.execute(select(Worker).where(Worker.state == WorkerState.ONLINE)).scalars().all()


def accelerators(session: Session) -> set[str]:
    """Every kind of accelerator a registered host has."""
    return set(session.execute(select(Worker.accelerator).distinct()).scalars())


def gpu_counts(session: Session) -> Sequence[int]:
    """Each registered host's number of GPUs."""
    return session.execute(select(Worker.gpus)).scalars().all()


# -- the capacity a job is checked against, and its version (service/models/workers.py) ---------

HOSTS_VERSION = "hosts"
_CAPACITY_VERSION = select(DataVersion.version).where(DataVersion.name == HOSTS_VERSION)
# A write's guard: the hosts are still those of the version bound as `hosts_version`.
CAPACITY_UNCHANGED = _CAPACITY_VERSION.scalar_subquery() == bindparam("hosts_version", type_=Integer)


def capacity_version(session: Session) -> int | None:
    """None when the row is missing: then no copy of the capacity can be checked, nor kept."""
    return session.execute(_CAPACITY_VERSION).scalar_one_or_none()


def capacity(session: Session) -> Sequence[Row[int, str]]:
    """(gpus, accelerator) of every registered host."""
    return session.execute(select(Worker.gpus, Worker.accelerator)).all()


def bump_capacity_version(session: Session) -> None:
    """In the transaction that registers a host or changes its GPUs or accelerator: every copy
    of the capacity taken before it fails its guard from this commit on."""
    session.execute(
        update(DataVersion)
        .where(DataVersion.name == HOSTS_VERSION)
        .values(version=DataVersion.version + 1)
        .execution_options(synchronize_session=False)
    )


# Three columns of each host, not whole rows: with a thousand hosts the reaper runs every
# second (bench/scale.py).
_HOST_SESSIONS = select(Worker.name, Worker.state, Worker.session)


def host_sessions(session: Session) -> Sequence[Row[str, str, str]]:
    """(name, state, session) of every host."""
    return session.execute(_HOST_SESSIONS).all()


def add_allocations(session: Session, rows: Iterable[GpuAllocation]) -> None:
    session.add_all(rows)


# -- contract §12: what preemption may stop, and hosts being drained ----------------------------


def held_by_jobs(session: Session) -> Sequence[Row[int, str, int]]:
    """(job id, host, GPUs) for every job holding GPUs: preemption's view of the cluster."""
    query = select(GpuAllocation.job_id, GpuAllocation.worker_name, func.count()).group_by(
        GpuAllocation.job_id, GpuAllocation.worker_name
    )
    return session.execute(query).all()


def lowest_preemptible_priority(session: Session, states: tuple[str, ...]) -> int | None:
    """The lowest priority of a preemptible job in `states` that is not being stopped."""
    query = select(func.min(Job.priority)).where(
        Job.state.in_(states), Job.preemptible.is_(True), Job.preempting_since.is_(None)
    )
    return session.execute(query).scalar_one_or_none()


def draining_hosts(session: Session) -> list[str]:
    return list(session.execute(select(Worker.name).where(Worker.draining_since.is_not(None))).scalars())


def jobs_with_nodes_on(session: Session, hosts: list[str], states: tuple[str, ...]) -> list[int]:
    """Jobs in `states` with a node of their current attempt on one of `hosts`, not being stopped."""
    query = (
        select(Job.id)
        .join(NodeRun, (NodeRun.job_id == Job.id) & (NodeRun.attempt == Job.attempt))
        .where(NodeRun.worker_name.in_(hosts), Job.state.in_(states), Job.preempting_since.is_(None))
        .distinct()
    )
    return list(session.execute(query).scalars())


def jobs_holding_gpus_on(session: Session, name: str) -> int:
    """How many jobs hold GPU slots on the host (a drained host holds none)."""
    query = select(func.count(func.distinct(GpuAllocation.job_id))).where(GpuAllocation.worker_name == name)
    return int(session.execute(query).scalar_one())


def any_preempting(session: Session) -> bool:
    """Whether some job's attempt is being stopped for another job."""
    query = (
        select(Job.id)
        .where(
            Job.preempted_by.is_not(None),
            Job.preempting_since.is_not(None),
            Job.state.in_((JobState.SCHEDULED, JobState.RUNNING, JobState.CANCELLING)),
        )
        .limit(1)
    )
    return session.execute(query).first() is not None


def job_facts(
    session: Session, job_ids: set[int]
) -> Sequence[Row[int, int, int, datetime | None, bool, str, datetime | None, int | None]]:
    """(id, priority, owner, started_at, preemptible, state, preempting_since, preempted_by)."""
    if not job_ids:
        return []
    query = select(
        Job.id,
        Job.priority,
        Job.owner_id,
        Job.started_at,
        Job.preemptible,
        Job.state,
        Job.preempting_since,
        Job.preempted_by,
    ).where(Job.id.in_(sorted(job_ids)))
    return session.execute(query).all()


def host_subnet(session: Session, address: str) -> str | None:
    found = session.execute(select(HostSubnet.subnet).where(HostSubnet.address == address))
    return found.scalar_one_or_none()


def taken_subnets(session: Session) -> set[str]:
    return set(session.execute(select(HostSubnet.subnet)).scalars())


def host_subnets(session: Session) -> list[tuple[str, str]]:
    return [(a, s) for a, s in session.execute(select(HostSubnet.address, HostSubnet.subnet))]


def set_host_subnet(session: Session, address: str, subnet: str) -> None:
    """The host's job subnet, in place of whatever it held (flushed: a clash raises here)."""
    kept = session.get(HostSubnet, address)
    if kept is None:
        session.add(HostSubnet(address=address, subnet=subnet))
    else:
        kept.subnet = subnet
    session.flush()


def add_host_subnet(session: Session, address: str, subnet: str) -> None:
    """Flushed at once: a unique clash (another host took it meanwhile) raises here."""
    session.add(HostSubnet(address=address, subnet=subnet))
    session.flush()
