"""Growing elastic jobs back (contract §12), in the scheduler pass's transaction.

A running elastic job below its most nodes grows when hosts are free for more of its nodes,
no queued job of equal or higher priority could want them, and its last resize is at least
`resize_interval_s` old. It grows at its next checkpoint, so that the restart loses nothing:
the pass notes when it first wanted to grow (`resize_wanted_at`), and once a checkpoint
newer than that is listed, stops the attempt for the resize (`service.jobs.elastic`); the
job is placed again at once, first of its priority. The room is looked at again in every
pass: a wish whose room has gone is dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from service.config import Settings
from service.hosts import repository as hosts_repo
from service.jobs import elastic
from service.jobs import repository as jobs_repo
from service.jobs.states import RUNNING, lock_job
from service.models import Job, Worker, utcnow
from service.usage.repository import gpus_in_use
from service.users import repository as users_repo

log = logging.getLogger("torchjobs.scheduler")


@dataclass
class Room:
    """Free GPU slots per open host, taken from as this pass lets jobs grow; and which hosts
    give a multi-node job's nodes networks of their own (a job grows onto its own kind only:
    placement.one_network_kind)."""

    free: dict[str, int]
    meshed: set[str] = field(default_factory=set)

    def _hosts_for(self, job: Job, own_hosts: set[str]) -> list[str]:
        kind = bool(own_hosts & self.meshed)
        return sorted(
            n
            for n, k in self.free.items()
            if k >= job.gpus_per_node and n not in own_hosts and (n in self.meshed) == kind
        )

    def extra_nodes(self, job: Job, own_hosts: set[str], quota_left: int | None) -> int:
        """How many more nodes the job could have: one per free host it is not on yet."""
        hosts = len(self._hosts_for(job, own_hosts))
        extra = min(hosts, (job.nodes_max or job.nodes) - job.nodes)
        if quota_left is not None:
            extra = min(extra, quota_left // job.gpus_per_node)
        return max(extra, 0)

    def take(self, job: Job, own_hosts: set[str], nodes: int) -> None:
        """Hold the room a job will grow into from the jobs after it in this pass."""
        for name in self._hosts_for(job, own_hosts)[:nodes]:
            self.free[name] -= job.gpus_per_node


def grow(session: Session, settings: Settings) -> None:
    jobs = jobs_repo.growable_jobs(session)
    if not jobs:
        return
    top_queued = jobs_repo.top_queued_priority(session)
    room = _room(session)
    latest = jobs_repo.latest_checkpoints(session, {j.id for j in jobs})
    quota_left = _quota_left(session, {j.owner_id for j in jobs})
    now = utcnow()
    for job in jobs:
        own = {r.worker_name for r in jobs_repo.runs_of(session, job.id, job.attempt)}
        extra = room.extra_nodes(job, own, quota_left.get(job.owner_id))
        wanted = (
            extra > 0
            and (top_queued is None or top_queued < job.priority)
            and _interval_passed(job.last_resize_at, now, settings.resize_interval_s)
        )
        if not wanted:
            if job.resize_wanted_at is not None:
                _set_wish(session, job.id, None)
            continue
        room.take(job, own, extra)
        if job.resize_wanted_at is None:
            _set_wish(session, job.id, now)
        elif job.id in latest and latest[job.id].created_at > job.resize_wanted_at:
            _grow_now(session, job.id, job.nodes + extra)


def _room(session: Session) -> Room:
    used = hosts_repo.used_slots(session)
    workers = hosts_repo.online_workers(session)
    return Room(
        free={w.name: w.gpus - len(used.get(w.name, ())) for w in workers if _room_to_grow(w)},
        meshed={w.name for w in workers if w.meshes},  # the job's own hosts among them
    )


def _room_to_grow(w: Worker) -> bool:
    """Open, healthy and not draining; and a grown job is a multi-node one, so a host that keeps
    those on its network (a normal user's worker) is no room for it."""
    open_ = w.open_to_all and w.multinode_open_to_all
    return open_ and w.quarantine_reason is None and w.draining_since is None


def _quota_left(session: Session, owner_ids: set[int]) -> dict[int, int | None]:
    held = gpus_in_use(session, owner_ids)
    return {
        u.id: None if u.gpu_quota is None else u.gpu_quota - held.get(u.id, 0)
        for u in users_repo.quotas(session, owner_ids)
    }


def _interval_passed(last: datetime | None, now: datetime, interval_s: float) -> bool:
    return last is None or now - last >= timedelta(seconds=interval_s)


def _set_wish(session: Session, job_id: int, at: datetime | None) -> None:
    job = lock_job(session, job_id)
    if job is not None and job.state == RUNNING and job.preempting_since is None:
        job.resize_wanted_at = at


def _grow_now(session: Session, job_id: int, to: int) -> None:
    job = lock_job(session, job_id)
    if job is None or job.state != RUNNING or job.preempting_since is not None:
        return
    log.info("job %s grows from %s to up to %s nodes at its checkpoint", job.id, job.nodes, to)
    elastic.grow_now(session, job)
