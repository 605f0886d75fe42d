"""Every torchrun start of a node: one warm torchrun agent kept ready per worker (see
warm_agent.py), or a cold one.

`start()` hands a launch to the waiting agent when there is one, alive, for the same
interpreter, and asks a long-lived spawner thread for the next; otherwise (two launches at
once, the spare died, warm agents turned off) it starts `python -m torch.distributed.run`
cold, as before. Either way the caller gets a `subprocess.Popen` whose process leads its own
process group and gets SIGTERM if the worker dies, so supervision, stops and clean-up are the
same for both. The spawner thread lives as long as the worker: PR_SET_PDEATHSIG fires when
the thread that started a process ends, so a warm agent gets its SIGTERM exactly when the
worker goes away. No `preexec_fn` (see service/parent_death.py): the worker forks from
several threads at once. On a CPU worker (`spawn_when_idle`) the next spare is started only
when none of the worker's nodes runs (`node_running()`), not on the cores its jobs train on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from service.parent_death import dying_with_parent
from workers.launcher import lifeline
from workers.launcher.cgroups import NodeGroup
from workers.launcher.command import LaunchPlan
from workers.launcher.procs import kill_group, pids_in_namespace, sandbox_namespace
from workers.launcher.sandbox import RUN_DIR
from workers.launcher.sandbox_spares import SpareDirs, SpareSandboxes

# makes the node's run folder, handed to the given uid (a spare's), else the plan's
Prepare = Callable[..., None]

log = logging.getLogger("torchjobs.worker")

TORCHRUN = ("-m", "torch.distributed.run")
PIPE_BUFFER = 64 * 1024  # Linux's default: a write up to this size never waits for the reader
ADOPT_POLL_S = 0.01


class WarmAgentPool:
    def __init__(
        self,
        base_env: Mapping[str, str],
        enabled: bool = True,
        spawn_when_idle: bool = False,
        handoff_timeout_s: float = 60.0,
        sandboxes: SpareSandboxes | None = None,
    ) -> None:
        self.base_env, self.enabled, self.spawn_when_idle = dict(base_env), enabled, spawn_when_idle
        self.sandboxes = sandboxes  # spares in a sandbox each (sandbox_spares.py), or plain ones
        self.handoff_timeout_s = handoff_timeout_s  # for the agent to take a launch (see _hand_over)
        self._running = 0  # nodes between node_running()'s enter and exit
        self.python = sys.executable
        self._spare: subprocess.Popen[bytes] | None = None
        self._spare_dirs: SpareDirs | None = None  # the spare's sandbox folders, when sandboxed
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # _running fell to 0, or closing
        self._wanted = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._spawn_loop, name="torchjobs-warm-agents", daemon=True)
        self.warm_starts = self.cold_starts = 0

    def begin(self) -> WarmAgentPool:
        if self.enabled:
            self._wanted.set()
            self._thread.start()
        return self

    def ready(self) -> bool:
        """A warm agent is waiting (it may still be importing torch)."""
        with self._lock:
            return self._spare is not None and self._spare.poll() is None

    @contextlib.contextmanager
    def node_running(self) -> Iterator[None]:
        """Around a node's launch and life. With `spawn_when_idle` the replacement spare waits
        until no node of this worker runs: importing torch takes a core for a second or two,
        and on a CPU worker the cores are the very slots its jobs train on."""
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._changed.notify_all()

    def close(self) -> None:
        self._stopping.set()
        self._wanted.set()
        with self._lock:
            spare, self._spare = self._spare, None
            dirs, self._spare_dirs = self._spare_dirs, None
            self._changed.notify_all()
        if spare is not None:
            _retire(spare)
        if dirs is not None and self.sandboxes is not None:
            self.sandboxes.discard(dirs)

    def launch(
        self, plan: LaunchPlan, prepare: Prepare, group: NodeGroup | None = None
    ) -> subprocess.Popen[bytes]:
        """The node's agent: `prepare()` makes its run folder first (in a warm sandbox's case,
        from the spare's own folders, which is why it is called here). With `group`, all of
        the node runs in the node's control groups (cgroups.py): a cold agent is born there, a
        warm one is moved in before it takes the launch."""
        if not plan.sandboxed:
            prepare()
            return self.start(plan.argv, plan.process_env, plan.cwd, plan.paths.agent_log, group)
        proc = self._take_sandboxed(plan, prepare, group)
        if proc is not None:
            return proc
        prepare()  # again where a spare's hand-over failed: it only makes what is missing
        self.cold_starts += 1
        return self._cold(_inside(plan.argv, group), plan.process_env, plan.cwd, plan.paths.agent_log)

    def _take_sandboxed(
        self, plan: LaunchPlan, prepare: Prepare, group: NodeGroup | None = None
    ) -> subprocess.Popen[bytes] | None:
        """A spare sandbox moved under the node and handed its launch, or None (then nothing
        of a spare is left, and the run folder may already be made)."""
        if self.sandboxes is None or not self._spare_fits(plan):
            return None
        proc, dirs = self._take()
        if proc is None or dirs is None:
            if dirs is not None:
                self.sandboxes.discard(dirs)
            if proc is not None:
                _kill(proc)
            return None
        if not self._sandbox_up(proc):
            log.warning("the warm sandbox never came up (exit %s); starting the node cold", proc.poll())
            _kill(proc)
            self.sandboxes.discard(dirs)
            return None
        if plan.hosts and not self.sandboxes.name_nodes(dirs, plan.hosts):
            _kill(proc)  # a spare with the host's /etc/hosts cannot serve a mesh node
            self.sandboxes.discard(dirs)
            return None
        try:
            self.sandboxes.place(dirs, plan)
        except OSError as exc:
            log.warning("could not move the warm sandbox under the node (%s); starting it cold", exc)
            _kill(proc)
            self.sandboxes.discard(dirs)
            return None
        prepare(dirs.owner)  # the node runs as the uid its spare was given
        if group is not None:  # the spare's bwrap and everything in its sandbox
            ns = sandbox_namespace(proc.pid)
            group.add([proc.pid, *(pids_in_namespace(ns) if ns else [])])
        log_path = RUN_DIR / plan.paths.agent_log.name
        request = _request(plan.torchrun_argv, plan.env, RUN_DIR, log_path, plan.routes)
        if self._hand_over(proc, request, plan.paths.agent_log):
            self.warm_starts += 1
            return proc
        return None

    def _spare_fits(self, plan: LaunchPlan) -> bool:
        """A spare waits for a node of its network's kind: its own namespace (a single-node
        job's, or a multi-node job's node in a mesh: its agent waits for the veth the
        supervisor moves in, `plan.routes`), or the host's."""
        fits = self.sandboxes is not None and self.sandboxes.private_network == plan.private_network
        return self.enabled and fits

    def _sandbox_up(self, proc: subprocess.Popen[bytes]) -> bool:
        """The spare's `up` line read (warm_agent.py): bubblewrap has made its binds, so its
        folders may be moved under the node. Within `handoff_timeout_s`, else False."""
        if proc.stdout is None:
            return True
        deadline = time.monotonic() + self.handoff_timeout_s
        poller = select.poll()  # not select(): a busy worker's descriptors pass 1023
        poller.register(proc.stdout.fileno(), select.POLLIN)
        try:
            while time.monotonic() < deadline:
                if poller.poll(100):
                    return os.read(proc.stdout.fileno(), 3) == b"up\n"
                if proc.poll() is not None:
                    return False
            return False
        finally:
            proc.stdout.close()  # read once, never again: the job never talks to the worker here

    def start(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path,
        group: NodeGroup | None = None,
    ) -> subprocess.Popen[bytes]:
        """The launch's agent, warm when one is ready for this argv and takes it, else cold."""
        proc, dirs = self._take() if self._warmable(argv) else (None, None)
        if proc is not None and dirs is not None and self.sandboxes is not None:
            _kill(proc)  # a sandboxed spare never takes a launch outside a sandbox
            self.sandboxes.discard(dirs)
            proc = None
        if proc is not None and group is not None:
            group.add([proc.pid])  # a warm agent starts its ranks only once it takes the launch
        if proc is not None and self._hand_over(proc, _request(argv, env, cwd, log_path), log_path):
            self.warm_starts += 1
            return proc
        self.cold_starts += 1
        return self._cold(_inside(argv, group), env, cwd, log_path)

    def _cold(
        self, argv: list[str], env: Mapping[str, str], cwd: Path, log_path: Path
    ) -> subprocess.Popen[bytes]:
        with open(log_path, "wb") as out:
            return subprocess.Popen(
                dying_with_parent(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=lifeline.pass_fds(),  # a sandbox's PID 1 watches it (unused outside one)
            )

    def _hand_over(self, proc: subprocess.Popen[bytes], data: bytes, log_path: Path) -> bool:
        """Give the launch to a waiting agent; False (and the agent ended) when it does not take it.

        Taking it is visible: the agent opens the launch's log first thing. One that has not
        within `handoff_timeout_s` (stuck, or dead before it read) is killed, and the launch
        starts cold instead of waiting on it for good. A request over one pipe buffer goes cold
        too: writing it could block on an agent that never reads.
        """
        why = "its launch request is larger than a pipe buffer"
        if len(data) < PIPE_BUFFER:
            try:
                assert proc.stdin is not None
                proc.stdin.write(data)
                proc.stdin.close()
                if self._adopted(proc, log_path):
                    return True
                why = f"it did not take the launch within {self.handoff_timeout_s:g} s"
            except OSError as exc:  # it died between the check and the write
                why = f"{exc.__class__.__name__}: {exc}"
        _kill(proc)
        log.warning("warm torchrun agent unusable (%s, exit %s); starting one cold", why, proc.returncode)
        return False

    def _adopted(self, proc: subprocess.Popen[bytes], log_path: Path) -> bool:
        deadline = time.monotonic() + self.handoff_timeout_s
        while not log_path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                return log_path.exists()
            time.sleep(ADOPT_POLL_S)
        return True

    def _warmable(self, argv: list[str]) -> bool:
        return self.enabled and len(argv) > 3 and argv[0] == self.python and tuple(argv[1:3]) == TORCHRUN

    def _take(self) -> tuple[subprocess.Popen[bytes] | None, SpareDirs | None]:
        """The spare if it is alive, and its sandbox's folders if it has any (both go)."""
        with self._lock:
            spare, self._spare = self._spare, None
            dirs, self._spare_dirs = self._spare_dirs, None
        self._wanted.set()
        if spare is not None and spare.poll() is None:
            return spare, dirs
        if spare is not None:
            log.warning("the warm torchrun agent had exited (%s); starting one cold", spare.returncode)
        if dirs is not None and self.sandboxes is not None:
            self.sandboxes.discard(dirs)
        return None, None

    def _spawn_loop(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stopping.is_set() or (self.spawn_when_idle and not self._wait_idle()):
                return
            with self._lock:
                if self._spare is not None and self._spare.poll() is None:
                    continue
            try:
                spare, dirs = self._spawn()
            except OSError as exc:
                log.warning("could not start a warm torchrun agent (%s); launches start cold", exc)
                self._stopping.wait(5.0)
                self._wanted.set()
                continue
            with self._lock:
                old, self._spare_dirs = self._spare_dirs, dirs
                self._spare = spare
            if old is not None and self.sandboxes is not None:  # the spare before it had died
                self.sandboxes.discard(old)

    def _wait_idle(self) -> bool:
        """Until no node runs; False if the pool closes first."""
        with self._changed:
            self._changed.wait_for(lambda: self._running == 0 or self._stopping.is_set())
        return not self._stopping.is_set()

    def _spawn(self) -> tuple[subprocess.Popen[bytes], SpareDirs | None]:
        if self.sandboxes is not None:
            return self.sandboxes.spawn()
        return subprocess.Popen(
            dying_with_parent([self.python, "-m", "workers.launcher.warm_agent"]),
            env={**self.base_env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        ), None


def _inside(argv: list[str], group: NodeGroup | None) -> list[str]:
    return group.join_argv(argv) if group is not None else argv


def _request(
    argv: list[str],
    env: Mapping[str, str],
    cwd: Path,
    log_path: Path,
    routes: tuple[float, int] | None = None,
) -> bytes:
    """The one line a warm agent reads (warm_agent.adopt): torchrun's arguments and the rest,
    and the routes it waits for first (a mesh node's)."""
    request = {"args": argv[3:], "env": dict(env), "cwd": str(cwd), "log": str(log_path), "routes": routes}
    return json.dumps(request).encode() + b"\n"


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """An agent that will not be used, with anything it started (it leads its own group)."""
    kill_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    proc.wait()


def _retire(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()  # end of input: an idle warm agent exits by itself
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
        return
    proc.kill()
