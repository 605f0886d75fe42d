"""The reaper, the first step of every scheduler pass (`service.scheduler.placement_pass`):
hosts silent past the heartbeat timeout go offline, nodes whose host is gone or that never
started in time are lost (their jobs retry or fail), and a job being cancelled with no node
left running has its pending nodes closed, and ends. It runs in the pass's transaction (on
PostgreSQL, under the pass's advisory lock).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.orm import Session

from service.checkpoints.folders import end_node
from service.config import Settings
from service.db import Database
from service.hosts import repository as hosts_repo
from service.hosts.health import HostVerdict, record_node_end
from service.hosts.states import take_offline
from service.jobs import repository as jobs_repo
from service.jobs.lifecycle import cancel_pending_nodes, lose_node, tell_quarantined
from service.jobs.preemption import settle, stopping_jobs
from service.models import utcnow
from service.nodes.values import NodeKey
from service.states import NodeState, WorkerState
from service.storage import Storage

log = logging.getLogger("torchjobs.scheduler")


def reap(session: Session, settings: Settings, judge_silence: bool = True) -> list[NodeKey]:
    """Workers silent past the timeout go offline; their nodes are lost; their jobs retry or fail.
    Returns the nodes lost (their unlisted checkpoint parts: `clean_lost_parts`).

    Not `judge_silence`: the database was away a moment ago (`DatabaseOutages`), so nobody is
    taken offline, and no node is late, for a silence that was the database's own."""
    now = utcnow()
    cutoff = now - timedelta(seconds=settings.heartbeat_timeout_s)
    for worker in hosts_repo.stale_online(session, cutoff) if judge_silence else ():
        if take_offline(worker):
            log.warning("worker %s missed its heartbeats: offline", worker.name)
    # Three columns of each host and five of each active node, not whole rows: with a thousand
    # hosts this pass runs every second (bench/scale.py); rows are loaded for the lost only.
    sessions = {name: (state, current) for name, state, current in hosts_repo.host_sessions(session)}
    lost: dict[int, str] = {}
    for run_id, worker_name, state, worker_session, created_at, node_rank in jobs_repo.active_runs(session):
        host_state, current = sessions.get(worker_name, (WorkerState.OFFLINE, None))
        gone = host_state == WorkerState.OFFLINE or (state == NodeState.RUNNING and worker_session != current)
        late = (
            judge_silence
            and state == NodeState.PENDING
            and (now - created_at).total_seconds() > settings.rendezvous_timeout_s
        )
        if gone or late:
            lost[run_id] = "worker lost" if gone else f"node {node_rank} did not start in time"
    runs = jobs_repo.node_runs_by_ids(session, list(lost)) if lost else []
    for run in runs:
        reason = lost[run.id]
        if lose_node(session, run, reason) and record_node_end(
            session, run.worker_name, HostVerdict.FAILED_HERE, reason, settings.quarantine_after
        ):
            tell_quarantined(session, run.job_id, run.worker_name)
    for job in stopping_jobs(session):  # preempted or drained, whose nodes have all ended (§12)
        settle(session, job)
    for job in jobs_repo.cancelling_jobs(session):  # (not a sweep's parent: settle_sweeps)
        if all(r.state != NodeState.RUNNING for r in jobs_repo.runs_of(session, job.id, job.attempt)):
            cancel_pending_nodes(session, job)
    return [NodeKey(job_id=r.job_id, attempt=r.attempt, node_rank=r.node_rank) for r in runs]


def clean_lost_parts(db: Database, settings: Settings, lost: list[NodeKey]) -> None:
    """After the pass commits: a lost node may be the last of its attempt to end, and no node is
    left to drop the attempt's unlisted checkpoint parts (contract §11: nothing orphaned in
    storage). `end_node` does, once every node of the attempt has ended."""
    if not lost:
        return
    storage = Storage.from_settings(settings)
    for key in lost:
        end_node(db, storage, key)
