"""Run one node's torchrun in its own process group, watch it, stop it, and report.

The supervisor reads the ranks' logs, events and checkpoints as they appear, polls the job's
state in the database (that is how a cancel or the failure of another node reaches it: no
Celery remote control), and on a stop sends SIGTERM to the whole group, then SIGKILL after
the grace period. When the agent exits, anything left in its group is killed too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from service.nodes.values import (
    END_WRITE_PATIENCE_S,
    Batch,
    JobControl,
    NodeKey,
    NodeLimits,
    NodeOutcome,
)
from service.states import JobState, NodeState
from workers.launcher import disk, job_network, stall_report
from workers.launcher.agents import WarmAgentPool
from workers.launcher.cgroups import NodeGroup
from workers.launcher.clocks import LOST_PEERS, STALL, TIME_LIMIT, NodeClock
from workers.launcher.command import (
    LaunchPlan,
    environment_log_of,
    identity_dir_of,
    processes_per_node,
)
from workers.launcher.dns_relay import DnsRelay
from workers.launcher.exit_wait import ExitWait
from workers.launcher.failure import TAIL_BYTES, is_retryable, read_error_file, root_cause, tail
from workers.launcher.folders import FileSig, FolderRules, FolderSig, FolderWatcher, FoundFolder
from workers.launcher.ingest import (
    LOG_MAX_BYTES,
    CheckpointChanged,
    CheckpointWatcher,
    EventsTail,
    Exactly,
    FoundCheckpoint,
    RankLogs,
    checkpoint_meta,
)
from workers.launcher.jobfiles import JobFolder
from workers.launcher.procs import (
    kill_group,
    kill_under,
    pids_in_namespace,
    pids_under,
    pin_sandbox_namespace,
    signal_all,
)
from workers.launcher.run_dir import copy_code, lay_out_run_dir, remove_run_dir
from workers.launcher.sandbox import write_hosts, write_identity
from workers.launcher.sandbox_spares import SpareSandboxes
from workers.launcher.stacks import rank_processes
from workers.launcher.staging import place_copy

log = logging.getLogger("torchjobs.worker")
DISK_LIMIT = "disk limit"
PREEMPT = "preempt"  # the control plane stops the attempt and queues the job again (§12)
EARLY_STOP = "early_stop"  # a sweep stops a child at an ASHA rung (service.jobs.asha)
# stops asked of the job, and how its node ends: an early-stopped child has succeeded (§13)
ENDED_BY_ASKING = {"cancel": NodeState.CANCELLED, EARLY_STOP: NodeState.SUCCEEDED}
POLL_S = 0.25
CONTROL_EVERY_S = 1.0
BATCH_EVERY_S = 0.5
# New events (progress, a checkpoint's notice) do not wait for the next half-second batch: the
# events file is looked at every EVENT_LOOK_S, and a batch goes out as soon as EVENT_GAP_S has
# passed since the last. A node that reports all the time then commits 1/EVENT_GAP_S times a
# second instead of 2, and a report reaches the database in EVENT_GAP_S / 2 on average
# instead of BATCH_EVERY_S / 2 (contract §3's streams; docs/benchmarks.md measures both).
EVENT_LOOK_S = 0.05
EVENT_GAP_S = 0.2
FOLDER_LOOK_S = 1.0  # a look at the checkpoint folder's folders walks every file beneath them
FOLDER_END_WAIT_S = 60.0  # node 0's wait at its end for the other nodes' parts of its folders
PEER_LOOK_EVERY_S = 5.0  # a multi-node job's look at whether its other nodes have all ended
# While stored output waits on a database that refuses it, read no more than this (the files
# keep the rest): back-pressure instead of memory without bound.
MAX_PENDING_BYTES = 64 * 1024 * 1024


@dataclass
class Hooks:
    """The supervisor's only ways out: injected so unit tests can drive it without a database."""

    write_batch: Callable[[Batch], JobControl | None]
    # (the open file, its name, the rank's notice of it, version): read from the descriptor
    record_checkpoint: Callable[[Exactly, str, dict[str, Any] | None, int], object]
    job_control: Callable[[], JobControl | None]
    node_event: Callable[[str, dict[str, Any]], object] = field(default=lambda *_: None)
    # when the attempt's other nodes had all ended (None while any runs): a straggler's clock
    peers_ended: Callable[[], datetime | None] = field(default=lambda: None)
    # folder checkpoints (contract §11); None: folders are not taken (unit tests of files only)
    folders: FolderHooks | None = None


@dataclass
class FolderHooks:
    """How a node stores its part of a folder checkpoint and how node 0 lists one (folders.py
    on the service side): (name, version, files, opener) -> part id; (part id, meta) -> the
    listed checkpoint's id or None while another node's part is not stored."""

    store_part: Callable[[str, int, FolderSig, Callable[[FileSig], Exactly]], int | None]
    try_list: Callable[[int, dict[str, Any] | None], int | None]
    horizon: Callable[[], int] = field(default=lambda: 0)
    note_look: Callable[[int, list[str]], object] = field(default=lambda *_: None)
    settle_s: float = 10.0


class NodeSupervisor:
    def __init__(
        self,
        *,
        key: NodeKey,
        plan: LaunchPlan,
        mode: str,
        gpus: int,
        hooks: Hooks,
        grace_s: float,
        shutdown: threading.Event,
        host: str = "",
        agents: WarmAgentPool | None = None,
        limits: NodeLimits | None = None,
        nnodes: int = 1,
        group: NodeGroup | None = None,
        log_max_bytes: int = LOG_MAX_BYTES,
        disk_max_bytes: int | None = None,
        resume_copy: tuple[Path, str] | None = None,
        dns: DnsRelay | None = None,
    ) -> None:
        self.key, self.plan, self.hooks, self.grace_s, self.shutdown = key, plan, hooks, grace_s, shutdown
        self.clock = NodeClock(limits or NodeLimits())
        self.nnodes = nnodes
        self.dns = dns  # a routed node's look-ups go through the worker's relay (dns_relay.py)
        self.dns_socket: socket.socket | None = None
        self.group = group  # the node's control groups: its limits, and all of it to kill
        self.disk_max_bytes = disk_max_bytes  # what the node may keep under its folders
        self.next_disk_look = 0.0
        self.disk_tally: disk.Tally | None = None  # the look that found the node past its limit
        self.next_peer_look = 0.0
        # torchrun's agent: a warm one from the worker's pool, or started cold
        self.agents = agents or cold_agents()
        self.host = host  # "worker NAME (ADDRESS)", so a failure names the machine it happened on
        paths = plan.paths
        nproc = processes_per_node(mode, gpus)
        preface = environment_log_of(paths.run_dir)
        # every file of the job's is taken through this folder's descriptor (jobfiles.py)
        self.folder = JobFolder(paths.run_dir, owner=plan.owner[0] if plan.owner else None)
        self.rank_logs = [
            RankLogs(self.folder, r, preface, logs=paths.logs.name, max_bytes=log_max_bytes)
            for r in range(nproc)
        ]
        self.events = EventsTail(self.folder, paths.events.name)
        self.checkpoints = CheckpointWatcher(self.folder, paths.checkpoints.name, max_bytes=disk_max_bytes)
        self.ckpt_meta: dict[str, dict[str, Any]] = {}
        self.lead = key.node_rank == 0
        settle = hooks.folders.settle_s if hooks.folders is not None else 10.0
        self.folders = FolderWatcher(
            self.folder,
            paths.checkpoints.name,
            FolderRules(settle_s=settle, lead=self.lead),
            max_bytes=disk_max_bytes,
        )
        self.awaiting: list[tuple[int, str]] = []  # node 0's stored parts not listed yet
        self.next_folder_look = 0.0
        # the checkpoint resumed from (the worker's staged copy, its name): placed, writable, in
        # the checkpoint folder before the ranks start, and not taken unless it changes (§11)
        self.resume_copy = resume_copy
        self.pending = Batch()  # read but not yet stored (its write failed): sent first next time
        self.unrecorded: list[FoundCheckpoint] = []  # complete files not yet recorded, in order
        self.seen: JobControl | None = None  # the job as the last stored batch found it
        self.storing_fails = False  # the last write or look failed: said once, not every look
        self.backlog = False  # a file had more than one read takes: look again without waiting
        self.stop_reason: str | None = None
        self.namespace: str | None = None  # the sandbox's PID namespace, once seen
        self.namespace_fd: int | None = None  # held open: that name is no other sandbox's meanwhile

    def prepare(self, owner: tuple[int, int] | None = None) -> None:
        """The run folder. In a sandbox its writable parts belong to the sandbox user; the
        ranks' environment waits there in a file only that user (and the worker) can read.
        `owner`: the uid a warm spare sandbox already runs as, which the node then takes."""
        paths, owner = self.plan.paths, owner or self.plan.owner
        self.folder.owner = owner[0] if owner else None
        if self.plan.owner is not None:  # a cold sandbox binds it (a spare has its own)
            write_identity(identity_dir_of(paths.run_dir), *self.plan.owner)
        if self.plan.hosts:
            write_hosts(identity_dir_of(paths.run_dir), self.plan.hosts)
        folders = lay_out_run_dir(self.plan)
        if self.plan.sandboxed:
            fd = os.open(paths.env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(self.plan.env, fh)
        if self.plan.code_dir is not None:
            copy_code(self.plan.code_dir, paths.workdir, owner)
        if owner is not None:
            for path in (*folders, paths.env_file):
                os.chown(path, *owner)
        self._place_resumed(owner)

    def _place_resumed(self, owner: tuple[int, int] | None) -> None:
        if self.resume_copy is None:
            return
        source, name = self.resume_copy
        try:
            if not place_copy(source, self.plan.paths.checkpoints, name, owner):
                return
            if source.is_dir():
                self.folders.adopt(name)
            else:
                self.checkpoints.adopt(name)
        except OSError:  # the ranks still find it at TORCHJOBS_RESUME_FROM
            log.warning("job %s: could not place checkpoint %r", self.key.job_id, name, exc_info=True)

    def run(self) -> NodeOutcome:
        with self.agents.node_running():
            proc = self.agents.launch(self.plan, self.prepare, self.group)
            try:
                self._plumb_network(proc)
                rc = self._watch(proc)
            finally:
                try:
                    self._kill_all(proc)
                finally:
                    if self.dns_socket is not None and self.dns is not None:
                        self.dns.close(self.dns_socket)
        try:
            self._ingest(final=True)
            self._await_listing()
            return self._outcome(rc)
        finally:
            self._close_files()

    def _plumb_network(self, proc: subprocess.Popen[bytes]) -> None:
        """The sandbox's veth, from outside: a routed node's, or a multi-node job's node's."""
        attached = self.plan.veth  # made before the launch (a multi-node job's node)
        if attached is None and self.plan.routed_subnet is not None:
            attached = job_network.reserve(self.plan.routed_subnet)  # a routed node's, now
        if attached is None:
            return
        inner = job_network.move_in(proc.pid, attached)
        if attached.gateway and self.dns is not None:
            try:
                self.dns_socket = self.dns.serve(inner)
            except (OSError, job_network.NetworkUnavailable) as exc:  # its look-ups refused at once
                log.warning("job %s node %s: no DNS relay: %s", self.key.job_id, self.key.node_rank, exc)
        log.info("job %s node %s: network %s via %s", self.key.job_id, self.key.node_rank,
                 attached.job_address, attached.host_if)  # fmt: skip

    def _close_files(self) -> None:
        for logs in self.rank_logs:
            logs.close()
        self.events.tail.close()
        for found in self.unrecorded:
            found.file.close()
        self.folder.close()
        self._release_namespace()

    def _release_namespace(self) -> None:
        """The node's processes are no longer named by its namespace (all were killed): let it go."""
        fd, self.namespace, self.namespace_fd = self.namespace_fd, None, None
        if fd is not None:
            os.close(fd)

    def _pids(self) -> list[int]:
        """The node's processes: its sandbox's, or (unsandboxed) those whose environment names
        its run folder, since ranks live in sessions of their own."""
        if not self.plan.sandboxed:
            return pids_under(str(self.plan.paths.run_dir) + "/")
        return pids_in_namespace(self.namespace) if self.namespace else []

    def _kill_all(self, proc: subprocess.Popen[bytes]) -> None:
        """Nothing of the node outlives it: SIGKILL to the sandbox's PID 1 takes the whole
        namespace with it; unsandboxed, every process found by its run folder."""
        signal_all(self._pids(), signal.SIGKILL)
        kill_group(proc.pid, signal.SIGKILL)
        if not self.plan.sandboxed:
            kill_under(str(self.plan.paths.run_dir) + "/")
        if self.group is not None:  # whatever escaped the namespace or the group: all of it
            self.group.kill_all()

    def _find_namespace(self, proc: subprocess.Popen[bytes]) -> None:
        """The sandbox's PID namespace, pinned (`pin_sandbox_namespace`) until the node ends:
        a stop signals every process of it, and unpinned its name could by then be another
        sandbox's (the kernel reuses a freed namespace's number at once), whose job it killed."""
        if self.plan.sandboxed and self.namespace is None:
            pinned = pin_sandbox_namespace(proc.pid)
            if pinned is not None:
                self.namespace, self.namespace_fd = pinned

    def _watch(self, proc: subprocess.Popen[bytes]) -> int:
        """Ingest every BATCH_EVERY_S (new events: EVENT_GAP_S after the last batch), look at
        the job every CONTROL_EVERY_S, and in between sleep until the next of those, the next
        look at the events file or the agent's exit, whichever comes first."""
        next_batch = next_control = last_batch = 0.0
        with ExitWait(proc) as exited:
            while True:
                rc = proc.poll()
                if rc is not None:
                    return rc  # run() reads what is left, all of it, once
                self._find_namespace(proc)
                now = time.monotonic()
                events_due = now >= last_batch + EVENT_GAP_S and self.events.waiting()
                if now >= next_batch or self._behind() or events_due:
                    self._ingest(final=False)
                    last_batch, next_batch = now, now + BATCH_EVERY_S
                if self.stop_reason is None and (now >= next_control or self._told_to_stop()):
                    next_control = now + CONTROL_EVERY_S
                    self.stop_reason = self._should_stop() or self._over_limit()
                    if self.stop_reason in (STALL, LOST_PEERS):
                        self._report_stall()
                    if self.stop_reason is not None:
                        return self._stop(proc)
                due = min(next_batch, next_control, time.monotonic() + EVENT_LOOK_S) - time.monotonic()
                exited.wait(0.0 if self._behind() else due)

    def _told_to_stop(self) -> bool:
        """The last stored batch brought a stop (an early stop, a preemption, a cancel): acted
        on at once, not at the next look at the job, up to CONTROL_EVERY_S later. A sweep's
        stopped child with short epochs trained one more of them while it waited."""
        seen = self.seen
        if seen is None:
            return False
        asked = getattr(seen, "stop", None) is not None or getattr(seen, "stop_grace_s", None) is not None
        return asked or seen[0] == JobState.CANCELLING

    def _behind(self) -> bool:
        """More output waits in the files than one look takes: look again at once, unless
        storing fails (a database that is away is not hammered)."""
        return self.backlog and not self.storing_fails

    def _should_stop(self) -> str | None:
        if self.shutdown.is_set():
            return "shutdown"
        control, self.seen = self.seen, None
        if control is None:
            try:
                control = self.hooks.job_control()
            except Exception:  # the database away: the ranks train on, the next look asks again
                self._storing(fails=True)
                return None
            if control is None:
                return "gone"
        state, attempt = control[0], control[1]
        if len(control) > 2:
            self.clock.stored_report(control[2])
        if attempt != self.key.attempt:
            return "superseded"
        if state == JobState.CANCELLING:
            return "cancel"
        if state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED):
            return "superseded"
        if getattr(control, "stop", None) == EARLY_STOP:  # a sweep's ASHA rung (contract §13)
            return EARLY_STOP
        return self._preempted(control)

    def _preempted(self, control: JobControl) -> str | None:
        """Preempted, or its host drained (contract §12): stopped with the job's own grace."""
        grace = getattr(control, "stop_grace_s", None)
        if grace is None:
            return None
        self.grace_s = float(grace)
        return PREEMPT

    def _over_limit(self) -> str | None:
        """The job's time limit, or its silence (contract §8), whose clock starts with the ranks."""
        if self.clock.watches_silence and self.clock.ranks_started is None and self._rank_pids():
            self.clock.ranks_up()
        now = time.monotonic()
        if (
            self.nnodes > 1
            and self.clock.limits.peer_exit_timeout_s is not None
            and now >= self.next_peer_look
        ):
            self.next_peer_look = now + PEER_LOOK_EVERY_S
            try:
                self.clock.peers_ended(self.hooks.peers_ended())
            except Exception:  # the database away: the next look asks again
                log.debug("job %s node %s: could not look at the other nodes", *self._ids(), exc_info=True)
        return self.clock.verdict() or self._over_disk(now)

    def _over_disk(self, now: float) -> str | None:
        if self.disk_max_bytes is None or now < self.next_disk_look:
            return None
        self.next_disk_look = now + disk.LOOK_EVERY_S
        paths = self.plan.paths
        tally = disk.usage((paths.run_dir, paths.tmp), self.disk_max_bytes)
        if not tally.over:
            return None
        self.disk_tally = tally
        return DISK_LIMIT

    def _rank_pids(self) -> dict[int, int]:
        """local rank -> pid, only for the node's own local ranks: LOCAL_RANK is what the job's
        processes say of themselves (a forged 8000 would mean 8000 stack dumps)."""
        nproc = len(self.rank_logs)
        return {r: pid for r, pid in rank_processes(self._pids()).items() if 0 <= r < nproc}

    def _report_stall(self) -> None:
        """Before anything is killed: every rank's stack into its log, then the events."""
        limits = self.clock.limits
        if self.stop_reason == LOST_PEERS:
            stall = stall_report.alone(
                self.clock.alone_for() or 0.0, limits.stall_timeout_s, limits.peer_exit_timeout_s or 0.0
            )
        else:
            stall = stall_report.silent(
                self.key.job_id, self.clock.silent_for() or 0.0, limits.stall_timeout_s
            )
        log.warning("job %s node %s: stalled: %s", *self._ids(), stall.why)
        stall_report.write_stacks(self.key, stall, self.rank_logs, self._rank_pids())
        self._ingest(final=False)
        try:
            stall_report.send_events(self.key, stall, len(self.rank_logs), self.hooks.node_event)
        except Exception:  # the database away: the stop goes on; the logs keep the stacks
            log.warning("job %s node %s: could not store the stall events", *self._ids(), exc_info=True)

    def _storing(self, fails: bool) -> None:
        """Say when the database (or the storage) starts and stops refusing this node, once."""
        if fails and not self.storing_fails:
            log.warning(
                "job %s node %s: storing fails (database away?); the ranks go on, their output waits",
                *self._ids(),
                exc_info=True,
            )
        elif not fails and self.storing_fails:
            log.info("job %s node %s: storing works again; what waited is stored", *self._ids())
        self.storing_fails = fails

    def _stop(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGTERM to the agent and to every rank (each in its own session), SIGKILL after the grace."""
        log.info("job %s node %s: stopping (%s)", self.key.job_id, self.key.node_rank, self.stop_reason)
        self._find_namespace(proc)
        if not self.plan.sandboxed:  # in a sandbox, bwrap's outer process is left to end with it
            kill_group(proc.pid, signal.SIGTERM)
        signal_all(self._pids(), signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not self._pids():
                break
            self._ingest(final=False)
            time.sleep(POLL_S)
        self._kill_all(proc)
        return proc.wait()

    def _ingest(self, final: bool) -> None:
        """Store what the ranks wrote since the last look, as one batch (one transaction), then
        record the checkpoint files that are complete.

        While the node runs that is one batch per look, at most `MAX_READ` per file; at the end
        (`final`) batches follow each other until every file is drained, so that what a rank
        printed just before it exited is stored too. Whatever the database or the storage
        refused (a batch, a checkpoint) is kept and tried again first at the next look, and at
        the end for as long as `record_end` waits for the database: no byte, report or
        checkpoint is dropped because the database was away for a while.
        """
        deadline = time.monotonic() + END_WRITE_PATIENCE_S
        tries = 0
        while True:
            stored = self._store_batch(final) and self._record_checkpoints(final)
            if stored:
                self._storing(fails=False)
            if not final or (stored and not self.backlog):
                return
            if stored:
                continue  # the files hold more than one look takes
            tries += 1
            if time.monotonic() >= deadline:
                log.error("job %s node %s: giving up on storing the last output", *self._ids())
                self.pending, self.unrecorded = Batch(), []
                return
            time.sleep(min(10.0, 0.2 * 2**tries))

    def _store_batch(self, final: bool) -> bool:
        batch = self._collect(final)
        try:
            seen = self.hooks.write_batch(batch)
        except Exception:
            self._storing(fails=True)
            self.pending = batch
            return False
        if seen is not None:
            self.seen = seen
        return True

    def _record_checkpoints(self, final: bool) -> bool:
        return self._record_files(final) and self._record_folders(final)

    def _record_folders(self, final: bool) -> bool:
        """Folder checkpoints (contract §11): this node's part of each complete folder stored;
        on node 0 each then listed once every node's part is; on another node, a note of
        what it still holds unstored. At most every FOLDER_LOOK_S while the ranks run."""
        hooks = self.hooks.folders
        now = time.monotonic()
        if hooks is None or (not final and now < self.next_folder_look):
            return True
        self.next_folder_look = now + FOLDER_LOOK_S
        try:
            horizon = hooks.horizon() if not self.lead else 0
            for found in self.folders.poll(final=final):
                self.clock.heard()
                self._store_folder(hooks, found)
            for why in self.folders.take_refusals():
                self.rank_logs[0].note(f"[torchjobs] checkpoint not taken: {why}")
            if not self.lead:
                hooks.note_look(horizon, self.folders.rules.busy(self.folders.present))
            self._list_awaiting(hooks)
        except Exception:
            self._storing(fails=True)
            return False
        return True

    def _store_folder(self, hooks: FolderHooks, found: FoundFolder) -> None:
        try:
            part = hooks.store_part(
                found.name, found.version, found.files, lambda sig: self.folders.open_file(found.name, sig)
            )
        except CheckpointChanged as exc:  # looked at again: complete again, it is taken then
            self.folders.rules.untake(found.name, found.files)
            log.info("job %s: folder %r not stored yet: %s", self.key.job_id, found.name, exc)
            return
        except Exception:
            self.folders.rules.untake(found.name, found.files)
            raise
        if part is not None and self.lead:
            self.awaiting.append((part, found.name))

    def _list_awaiting(self, hooks: FolderHooks, *, in_order: bool = True) -> None:
        """The awaiting parts listed in the order they were stored, up to the first that cannot
        be yet: checkpoints are listed in the order the ranks saved them, so the newest listed
        is the newest saved (`latest_checkpoint`, resume, `keep_checkpoints` go by that order).
        Listing a later one first, while another node still stores its part of an earlier one,
        would make the earlier one the job's latest. `in_order=False` (every other node has
        ended: what cannot be listed now never will be) lists every one that can, still in
        order. On a failure the parts listed before it are awaited no more, and it and those
        after it are tried again."""
        waiting: list[tuple[int, str]] = []
        try:
            while self.awaiting:
                part, name = self.awaiting[0]
                if hooks.try_list(part, checkpoint_meta(self.ckpt_meta.get(name), name)) is None:
                    if in_order:
                        break
                    waiting.append(self.awaiting[0])
                self.awaiting.pop(0)
        finally:
            self.awaiting = waiting + self.awaiting

    def _await_listing(self) -> None:
        """Node 0, its ranks ended: its parts wait (bounded) for the other nodes' final looks,
        and no longer once every other node has ended (a node stores its parts before it
        reports its end; one lost with its host never will). A try that failed (the database
        away a moment) answers nothing: it is tried again, peers ended or not, until the
        deadline; otherwise the job would end with its last checkpoint never listed."""
        hooks = self.hooks.folders
        deadline = time.monotonic() + FOLDER_END_WAIT_S
        while hooks is not None and self.awaiting and time.monotonic() < deadline:
            time.sleep(0.5)
            peers_gone = self._peers_gone()
            try:
                self._list_awaiting(hooks, in_order=not peers_gone)
            except Exception:
                log.warning("job %s: could not list a folder checkpoint", self.key.job_id, exc_info=True)
                continue
            if peers_gone:
                break
        if self.awaiting:
            log.warning("job %s: folder checkpoints %s never whole on every node: not listed",
                        self.key.job_id, [n for _, n in self.awaiting])  # fmt: skip

    def _peers_gone(self) -> bool:
        try:
            return self.hooks.peers_ended() is not None
        except Exception:  # the database away a moment: wait on, as before
            return False

    def _record_files(self, final: bool) -> bool:
        """The complete files in the order they were written; on a failure that one and the
        ones after it wait for the next look."""
        fresh = self.checkpoints.poll(final=final)
        for why in self.checkpoints.take_refusals():  # in the job's own log: why it has none
            self.rank_logs[0].note(f"[torchjobs] checkpoint not taken: {why}")
        if fresh:
            self.clock.heard()
        todo, self.unrecorded = self.unrecorded + fresh, []
        for i, found in enumerate(todo):
            meta = checkpoint_meta(self.ckpt_meta.get(found.name), found.name)
            try:
                found.file.seek(0)  # from the start again where an earlier try failed midway
                self.hooks.record_checkpoint(found.file, found.name, meta, found.version)
            except CheckpointChanged as exc:  # not the file that was complete: never taken
                log.warning("job %s: checkpoint %r not stored: %s", self.key.job_id, found.name, exc)
            except Exception:
                self._storing(fails=True)
                self.unrecorded = todo[i:]
                return False
            found.file.close()
        return True

    def _collect(self, final: bool) -> Batch:
        batch, self.pending = self.pending, Batch()
        batch.stopping = batch.stopping or self.stop_reason is not None
        if sum(len(data) for _, _, data in batch.logs) >= MAX_PENDING_BYTES:
            self.backlog = True  # unread output is waiting in the files
            return batch
        backlog = False
        for logs in self.rank_logs:
            offset, data = logs.read_new(final=final)
            backlog = backlog or logs.backlog
            if data:
                batch.logs.append((logs.local_rank, offset, data))
        for event in self.events.read_new():
            if event.get("type") == "checkpoint" and isinstance(event.get("file"), str):
                self.ckpt_meta[event["file"]] = event
            else:
                batch.events.append(event)
        self.backlog = backlog or self.events.backlog
        if batch or any(logs.talking for logs in self.rank_logs):
            self.clock.heard()
        return batch

    def _ids(self) -> tuple[int, int]:
        return self.key.job_id, self.key.node_rank

    def _outcome(self, rc: int) -> NodeOutcome:
        if self.stop_reason in ENDED_BY_ASKING:
            return NodeOutcome(state=ENDED_BY_ASKING[self.stop_reason], exit_code=rc)
        if self.stop_reason in ("superseded", "gone", PREEMPT):  # (preempted: the scheduler's doing)
            error = "preempted" if self.stop_reason == PREEMPT else "stopped: the attempt ended elsewhere"
            return NodeOutcome(state=NodeState.LOST, exit_code=rc, error=error)
        if self.stop_reason == "shutdown":
            return NodeOutcome(state=NodeState.LOST, exit_code=rc, error="worker shut down", retryable=True)
        if self.stop_reason == DISK_LIMIT and self.disk_tally is not None:  # the job's own: not retried
            error = f"{self.disk_tally.why()} on node {self.key.node_rank}"
            return NodeOutcome(state=NodeState.FAILED, exit_code=rc, error=error)
        if self.stop_reason == TIME_LIMIT:
            limit = self.clock.limits.max_duration_s
            error = f"time limit: the job ran its max_duration_s of {limit} s; rank 0 was asked to checkpoint"
            return NodeOutcome(state=NodeState.FAILED, exit_code=rc, error=error)
        if self.stop_reason == LOST_PEERS:
            error = (
                f"stalled: node {self.key.node_rank} still ran {self.clock.limits.peer_exit_timeout_s:g} s "
                "after every other node of the attempt had ended (TORCHJOBS_PEER_EXIT_TIMEOUT_S); "
                "every rank's Python stack is in its log"
            )
            return NodeOutcome(state=NodeState.FAILED, exit_code=rc, error=error, retryable=True)
        if self.stop_reason == STALL:
            timeout = self.clock.limits.stall_timeout_s
            error = (
                f"stalled: no rank reported anything for {timeout:g} s (stall_timeout_s) on node "
                f"{self.key.node_rank}"
                + (f" ({self.host})" if self.host else "")
                + "; every rank's Python stack is in its log"
            )
            return NodeOutcome(state=NodeState.FAILED, exit_code=rc, error=error, retryable=True)
        if rc == 0:
            return NodeOutcome(state=NodeState.SUCCEEDED, exit_code=0)
        passed = self.group.passed() if self.group is not None else None
        if passed is not None:  # the job's own doing: not retried (contract §7 v3)
            error = f"{passed} on node {self.key.node_rank}"
            return NodeOutcome(state=NodeState.FAILED, exit_code=rc, error=error)
        return self._failure(rc)

    def _failure(self, rc: int) -> NodeOutcome:
        agent_tail = self.folder.read_tail(self.plan.paths.agent_log.name, TAIL_BYTES)
        agent_text = tail(agent_tail, lines=400)
        cause = root_cause(agent_text)
        logs = (
            self.rank_logs[cause.local_rank]
            if cause.local_rank is not None and cause.local_rank < len(self.rank_logs)
            else None
        )
        trace = read_error_file(logs.error_file()) if logs else None
        stderr_tail = tail(logs.stderr_tail(TAIL_BYTES)) if logs else ""
        where = f"node {self.key.node_rank}" + (f" on {self.host}" if self.host else "")
        if cause.rank is not None:
            where += f", rank {cause.rank} (local rank {cause.local_rank})"
        code = cause.exit_code if cause.exit_code is not None else rc
        body = trace or stderr_tail or tail(agent_tail, lines=20)
        error = f"{where} exited with code {code}\n{body}".strip()
        retry = is_retryable(code, error + agent_text, signalled_by_us=False)
        return NodeOutcome(state=NodeState.FAILED, exit_code=code, error=error[-16000:], retryable=retry)

    def cleanup(self) -> None:
        self._release_namespace()  # (run() did, unless it raised)
        remove_run_dir(self.plan.paths)
        if self.group is not None:
            self.group.remove()


def cold_agents() -> WarmAgentPool:
    """Every launch a fresh `python -m torch.distributed.run` (unit tests, warm agents off)."""
    return WarmAgentPool({}, enabled=False)


def warm_agents(
    base_env: dict[str, str],
    enabled: bool,
    spawn_when_idle: bool = False,
    sandboxes: SpareSandboxes | None = None,
) -> WarmAgentPool:
    """The worker's pool: one agent kept waiting with torch imported (warm_agent.py).

    Every agent leads its own process group (so a stop reaches every rank) and gets SIGTERM if
    the thread that started it ends: the node task (cold start), which lives until the agent
    has exited, or the warm-agent spawner, which lives as long as the worker. Either way the
    signal means the worker died; torchrun forwards it to its ranks, which checkpoint and
    exit: no orphan keeps training on GPU slots the scheduler has already given to someone else.
    """
    pool = WarmAgentPool(base_env, enabled=enabled, spawn_when_idle=spawn_when_idle, sandboxes=sandboxes)
    return pool.begin()
