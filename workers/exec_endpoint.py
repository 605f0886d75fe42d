"""The worker's exec endpoint (contract §14): a process started inside a running rank's
sandbox, or one TCP connection opened from there, over a connection from the API.

Why the API dials the worker (and not the other way round): the API has just authorised the
caller and holds the client's socket; the worker has only the database in common with it.
So each worker process listens on a TCP port of its own (`TORCHJOBS_EXEC_BIND`, default its
`--address`; `TORCHJOBS_EXEC_PORT`, default any), and publishes `ADDRESS:PORT` with a random
secret made at start in its `workers` row (service/nodes/exec_link.py). The API proves that it
knows the secret by an HMAC over a fresh nonce; anything else that connects (a job's code on
the host network can reach this port) is hung up on without a word. The secret is in no
environment and no file: a job never sees it. In `torchjobs up` the same path runs on
127.0.0.1.

What runs where: the node's supervisor (in this process, in the Celery thread that runs the
node) registers itself in NODES while it runs; a request names the job, attempt, node and
local rank, and the rank's process is found by LOCAL_RANK in the node's PID namespace
(procs.py, stacks.py), as stall stacks find it. workers/launcher/exec_command.py builds the
command that enters that sandbox. The process dies with the job (it lives in the node's PID
namespace and control groups, which the supervisor kills whole at the end), and with the
connection: when the API hangs up, every process of the exec's sessions is killed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import socketserver
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from service.nodes import exec_link
from workers.launcher import exec_command
from workers.launcher.cgroups import NodeGroup
from workers.launcher.command import LaunchPlan
from workers.launcher.exec_command import Refused
from workers.launcher.procs import pids_in_namespace, pids_under
from workers.launcher.sandbox import RUN_DIR
from workers.launcher.stacks import rank_processes

log = logging.getLogger("torchjobs.worker")
HANDSHAKE_TIMEOUT_S = 15.0
DRAIN_S = 0.2  # after the command exited: output still in the pipe is sent for this long


class RunningNode(Protocol):
    """What the endpoint reads of a node's supervisor (workers/launcher/supervisor.py)."""

    plan: LaunchPlan
    namespace: str | None
    group: NodeGroup | None

    @property
    def key(self) -> Any: ...


class Nodes:
    """The nodes this worker process runs now, by (job id, node rank)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[tuple[int, int], RunningNode] = {}

    @contextlib.contextmanager
    def running(self, node: RunningNode) -> Iterator[None]:
        key = (node.key.job_id, node.key.node_rank)
        with self._lock:
            self._nodes[key] = node
        try:
            yield
        finally:
            with self._lock:
                if self._nodes.get(key) is node:
                    del self._nodes[key]

    def get(self, job_id: int, node_rank: int) -> RunningNode | None:
        with self._lock:
            return self._nodes.get((job_id, node_rank))


NODES = Nodes()


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    control: int | None  # the write end of a pty session's resize pipe
    sessions: set[int] = field(default_factory=set)  # of its processes, as last seen
    # a sandboxed exec: the node's PID namespace and the rank's uid. Only a process of both is
    # ever signalled through a remembered session id: a session id, like a PID, is a number
    # the host may give to anyone once its processes are gone (a root daemon's, say)
    namespace: str | None = None
    uid: int | None = None


class Endpoint:
    """The listening socket and its secret; `address` is what the API is told."""

    def __init__(self, bind: str, port: int, advertise_host: str) -> None:
        self.secret = exec_link.new_secret()
        self.server = _Server((bind, port), _Handler)
        self.server.endpoint = self
        self.address = f"{_bracketed(advertise_host)}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="torchjobs-exec", daemon=True)

    def start(self) -> Endpoint:
        self.thread.start()
        log.info("exec endpoint listening on %s", self.address)
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start(bind: str, port: int, address: str) -> Endpoint | None:
    """The endpoint on `bind` (default: the worker's own address), or None when it cannot
    listen there (said in the log: exec then answers that this worker has no endpoint)."""
    try:
        return Endpoint(bind or address, port, address).start()
    except OSError as exc:
        log.warning("no exec endpoint (%s:%s: %s): exec and forward are off on this worker", bind, port, exc)
        return None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    endpoint: Endpoint

    def __init__(self, address: tuple[str, int], handler: type[socketserver.BaseRequestHandler]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)


# connections served at once: a job on the host network may connect too, and each one holds a
# thread for up to HANDSHAKE_TIMEOUT_S; past this, new ones are closed at once
MAX_CONNECTIONS = 256
_connections = threading.BoundedSemaphore(MAX_CONNECTIONS)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        server = self.server
        assert isinstance(server, _Server)
        if not _connections.acquire(blocking=False):
            return
        try:
            serve(sock, server.endpoint.secret)
        except OSError:
            pass  # the API went away
        except Exception:
            log.exception("exec session failed")
        finally:
            _connections.release()


def serve(sock: socket.socket, secret: str) -> None:
    """One connection: the handshake, then one session."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    nonce = exec_link.new_nonce()
    sock.sendall(exec_link.GREETING + nonce.encode() + b"\n")
    reader = sock.makefile("rb")
    line = reader.readline(exec_link.MAX_LINE)
    request = exec_link.verified(secret, nonce, line)
    if request is None:
        return  # not the API: nothing to say to it
    try:
        started = _start(request)
    except Refused as exc:
        _reply(sock, {"ok": False, "status": 400, "detail": str(exc)})
        return
    try:
        first = b""
        if request.get("op") == "forward":
            connected, first = _forward_connected(sock, started.proc)
            if not connected:
                return
        _reply(sock, {"ok": True})
        if first:  # the service spoke first: its first bytes came with the relay's status
            sock.sendall(exec_link.frame(exec_link.DATA, first))
        sock.settimeout(None)
        _relay(sock, reader, started)
    finally:
        _end(started)


def _reply(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _forward_connected(sock: socket.socket, proc: subprocess.Popen[bytes]) -> tuple[bool, bytes]:
    """The in-sandbox relay's first byte: 0 when it reached the port (and what came after it
    in the same read); else the refusal, sent to the API."""
    assert proc.stdout is not None
    poller = select.poll()  # not select(): a busy worker's descriptors pass 1023
    poller.register(proc.stdout.fileno(), select.POLLIN)
    ready = poller.poll(HANDSHAKE_TIMEOUT_S * 1000)
    first = os.read(proc.stdout.fileno(), 256) if ready else b""
    if first[:1] == b"\x00":
        return True, first[1:]
    why = first[1:].decode(errors="replace") or "no answer"
    _reply(sock, {"ok": False, "status": 400, "detail": f"could not connect inside the job: {why}"})
    return False, b""


def _start(request: dict[str, Any]) -> Started:
    job_id, node_rank = _int(request, "job_id"), _int(request, "node_rank")
    node = NODES.get(job_id, node_rank)
    if node is None or node.key.attempt != _int(request, "attempt"):
        raise Refused(f"node {node_rank} of job {job_id} is not running on this worker")
    local_rank = _int(request, "local_rank")
    if request.get("op") == "forward":
        argv = exec_command.forward_argv(exec_command.python(), _int(request, "port"))
        tty = False
    else:
        argv = [str(a) for a in request.get("argv") or []]
        tty = bool(request.get("tty"))
        if not argv:
            raise Refused("an empty command")
    return _spawn(node, local_rank, argv, tty)


def _int(request: dict[str, Any], name: str) -> int:
    value = request.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise Refused(f"bad {name}")
    return value


def _rank_pid(node: RunningNode, local_rank: int) -> int:
    plan = node.plan
    if plan.sandboxed:
        if node.namespace is None:
            raise Refused("the job's sandbox is still starting; try again in a moment")
        pids = pids_in_namespace(node.namespace)
    else:
        pids = pids_under(str(plan.paths.run_dir) + "/")
    pid = rank_processes(pids).get(local_rank)
    if pid is None:
        raise Refused(f"local rank {local_rank} is not running (yet) on node {node.key.node_rank}")
    return pid


def _spawn(node: RunningNode, local_rank: int, argv: list[str], tty: bool) -> Started:
    plan = node.plan
    pid = _rank_pid(node, local_rank)
    read_ctl, write_ctl = os.pipe() if tty else (-1, -1)
    held: list[int] = [read_ctl] if tty else []
    try:
        workdir = plan.env.get("TORCHJOBS_WORKDIR")  # as the ranks see it: their working directory
        if plan.sandboxed:
            userns = plan.isolation.method == "bwrap-userns"
            ns_fds, root_fd, uid, gid = _open_rank(pid, node, userns)
            held += [*ns_fds.values(), root_fd]
            inner = exec_command.entry_argv(
                exec_command.python(),
                plan.env,
                workdir or str(RUN_DIR),
                read_ctl if tty else None,
                argv,
                filtered=False,  # installed before the uid drop (exec_command.PREFILTER)
            )
            ctl = read_ctl if tty else None
            if userns:
                full = exec_command.userns_argv(ns_fds, root_fd, inner, control_fd=ctl)
            else:
                full = exec_command.sandboxed_argv(ns_fds, root_fd, uid, gid, inner, control_fd=ctl)
            work_dir: str | None = None
            owner: tuple[str | None, int | None] = (node.namespace, uid)
        else:
            full = exec_command.entry_argv(
                exec_command.python(),
                plan.env,
                workdir or str(plan.cwd),
                read_ctl if tty else None,
                argv,
                filtered=False,
            )
            work_dir = str(plan.paths.run_dir)
            owner = (None, None)
        if node.group is not None:
            full = node.group.join_argv(full)
        proc = subprocess.Popen(
            full,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=exec_command.host_env(),
            cwd=work_dir,
            pass_fds=tuple(held),
            start_new_session=True,
        )
    except Exception:
        if tty:
            os.close(write_ctl)
        raise
    finally:
        for fd in held:
            with contextlib.suppress(OSError):
                os.close(fd)
    namespace, rank_uid = owner
    return Started(
        proc=proc, control=write_ctl if tty else None, sessions={proc.pid}, namespace=namespace, uid=rank_uid
    )


def _open_rank(pid: int, node: RunningNode, userns: bool = False) -> tuple[dict[str, int], int, int, int]:
    """Descriptors on the rank's namespaces and root, from its /proc folder opened once (a
    /proc/PID descriptor refuses to serve another process that later takes that PID), checked
    to be of the node's PID namespace; and the rank's uid and gid, which must be the node's.

    `userns` (a non-root worker's sandbox): the rank is this worker's own uid, and its user
    namespace is opened too; a namespace the rank shares with the worker (a multi-node job's
    network) is left out, since joining one's own from inside the job's user namespace is
    refused by the kernel."""
    try:
        dirfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise Refused("the rank ended meanwhile") from exc
    fds: dict[str, int] = {}
    try:
        if os.readlink("ns/pid", dir_fd=dirfd) != node.namespace:
            raise Refused("the rank ended meanwhile")
        uid, gid = _ids(dirfd)
        _check_uid(node, uid, userns)
        fds = _open_namespaces(dirfd, userns)
        root = os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dirfd)
        if os.readlink("ns/pid", dir_fd=dirfd) != node.namespace:  # still that process
            os.close(root)
            raise Refused("the rank ended meanwhile")
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        raise Refused("the rank ended meanwhile") from exc
    except Refused:
        for fd in fds.values():
            os.close(fd)
        raise
    finally:
        os.close(dirfd)
    return fds, root, uid, gid


def _check_uid(node: RunningNode, uid: int, userns: bool) -> None:
    """The rank is the node's uid: this worker's own in a user namespace, else never root."""
    if userns:
        if uid != os.geteuid():
            raise Refused("the rank does not run as the node's uid")
    elif uid == 0 or (node.plan.owner is not None and uid != _node_uid(node)):
        raise Refused("the rank does not run as the node's uid")


def _open_namespaces(dirfd: int, userns: bool) -> dict[str, int]:
    """Descriptors on the rank's namespaces (its user namespace first, in a user namespace's
    sandbox, and none that is this worker's own there). Closed again when one fails."""
    fds: dict[str, int] = {}
    try:
        for name in (("user",) if userns else ()) + exec_command.NAMESPACES:
            if userns and name != "user" and _same_as_mine(dirfd, name):
                continue
            with contextlib.suppress(FileNotFoundError):
                fds[name] = os.open(f"ns/{name}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def _same_as_mine(dirfd: int, name: str) -> bool:
    try:
        return os.readlink(f"ns/{name}", dir_fd=dirfd) == os.readlink(f"/proc/self/ns/{name}")
    except OSError:
        return False


def _node_uid(node: RunningNode) -> int | None:
    """The uid the node's folders belong to (a warm spare's, when one took the launch)."""
    folder = getattr(node, "folder", None)
    owner = getattr(folder, "owner", None)
    if isinstance(owner, int):
        return owner
    return node.plan.owner[0] if node.plan.owner else None


def _ids(dirfd: int) -> tuple[int, int]:
    """Real uid and gid from /proc/PID/status (a rank cannot change them: no capabilities)."""
    fd = os.open("status", os.O_RDONLY, dir_fd=dirfd)
    with os.fdopen(fd, "rb") as fh:
        text = fh.read().decode(errors="replace")
    ids = {k: v.split() for k, _, v in (x.partition(":") for x in text.splitlines()) if k in ("Uid", "Gid")}
    return int(ids["Uid"][0]), int(ids["Gid"][0])


def _relay(sock: socket.socket, reader: Any, started: Started) -> None:
    """The API's frames into the process (another thread), its output out (this one), then
    the exit code."""
    proc = started.proc
    gone = threading.Event()
    inbound = threading.Thread(target=_inbound, args=(reader, sock, started, gone), daemon=True)
    inbound.start()
    assert proc.stdout is not None
    out, out_open = proc.stdout.fileno(), True
    output = select.poll()  # not select(): a busy worker's descriptors pass 1023
    output.register(out, select.POLLIN | select.POLLHUP)
    exited_at: float | None = None
    next_look = 0.0
    while not gone.is_set():
        if out_open:
            ready = output.poll(200)
            if ready:
                data = os.read(out, 65536)
                if data:
                    sock.sendall(exec_link.frame(exec_link.DATA, data))
                    continue
                out_open = False  # every holder of the pipe closed it
        else:
            gone.wait(0.2)
        now = time.monotonic()
        if now >= next_look:
            next_look = now + 1.0
            _remember_sessions(started)
        if _exited(proc):  # a background child may still hold the pipe: not waited for long
            exited_at = exited_at or now
            if not out_open or now - exited_at > DRAIN_S:
                break
    if gone.is_set():
        return
    _kill(started)  # what it left behind in its sessions
    code = proc.wait()
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N
    sock.sendall(exec_link.frame(exec_link.EXIT, json.dumps({"exit_code": code}).encode()))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether it exited, without reaping it: while it is a zombie its PID (the id of its
    session) cannot be given to another process, so `_kill` still names only the exec's."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _inbound(reader: Any, sock: socket.socket, started: Started, gone: threading.Event) -> None:
    proc = started.proc
    assert proc.stdin is not None
    os.set_blocking(proc.stdin.fileno(), False)  # a command that reads nothing must not hold us
    try:
        while True:
            header = reader.read(exec_link.HEADER.size)
            if len(header) < exec_link.HEADER.size:
                break
            kind, size = exec_link.HEADER.unpack(header)
            if size > exec_link.MAX_FRAME:
                break
            payload = reader.read(size)
            if len(payload) < size:
                break
            if not _deliver(started, kind, payload, sock):
                break
    except (OSError, ValueError):
        pass
    gone.set()
    _kill(started)


def _deliver(started: Started, kind: int, payload: bytes, sock: socket.socket) -> bool:
    """One frame from the API into the process; False once the API has hung up (seen while
    waiting for a command that does not read its stdin)."""
    stdin = started.proc.stdin
    assert stdin is not None
    # the process closed its stdin or exited; a resize that is no [rows, cols]
    with contextlib.suppress(OSError, ValueError, TypeError, RecursionError):
        if kind == exec_link.DATA and payload:
            return _write_while_connected(stdin.fileno(), payload, sock)
        if kind == exec_link.EOF:
            stdin.close()
        elif kind == exec_link.RESIZE and started.control is not None:
            rows, cols = json.loads(payload)
            os.write(started.control, f"{int(rows)} {int(cols)}\n".encode())
    return True


def _write_while_connected(fd: int, data: bytes, sock: socket.socket) -> bool:
    """All of `data` into the (non-blocking) pipe as the process reads it; False as soon as the
    API closes its side, whatever it still had in flight (POLLRDHUP: its FIN, even behind
    unread bytes)."""
    waiting = select.poll()
    waiting.register(fd, select.POLLOUT)
    waiting.register(sock.fileno(), select.POLLRDHUP)
    view = memoryview(data)
    while view:
        for ready_fd, events in waiting.poll(1000):
            if ready_fd == sock.fileno() and events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                return False
            if ready_fd == fd and events & (select.POLLERR | select.POLLHUP):
                raise BrokenPipeError
            if ready_fd == fd and events & select.POLLOUT:
                with contextlib.suppress(BlockingIOError):
                    view = view[os.write(fd, view) :]
    return True


def _end(started: Started) -> None:
    _kill(started)
    with contextlib.suppress(subprocess.TimeoutExpired):
        started.proc.wait(timeout=5)
    if started.control is not None:
        with contextlib.suppress(OSError):
            os.close(started.control)
    for stream in (started.proc.stdin, started.proc.stdout):
        with contextlib.suppress(OSError, ValueError):
            if stream is not None:
                stream.close()


def _remember_sessions(started: Started) -> None:
    """The sessions of the exec's processes, looked at while they run: a daemon that double
    forked is no descendant any more, but it stays in its session. Sandboxed execs only (an
    unsandboxed one's processes are the worker's uid on the host: its descendants only)."""
    if started.proc.returncode is None and started.namespace is not None:
        table = _process_table()
        mine = _descendants(started.proc.pid, table) - {started.proc.pid}
        started.sessions |= {table[pid][1] for pid in mine if pid in table}


def _kill(started: Started) -> None:
    """Every process of the exec's sessions: nsenter's (it was started in one of its own), and
    those its descendants made (the command's, a pty's), double-forked daemons included. One
    that made a session of its own after that lives until the job ends (its PID namespace and
    control groups are killed whole then)."""
    proc = started.proc
    if proc.returncode is not None:
        return  # reaped: done before its wait (an id of a session long gone may be another's now)
    _remember_sessions(started)
    table = _process_table()
    mine = _descendants(proc.pid, table) - {proc.pid}
    in_sessions = {pid for pid, (_, sid) in table.items() if sid in started.sessions}
    with contextlib.suppress(ProcessLookupError):
        proc.kill()  # nsenter's: our own child, not reaped yet, so this PID is still it
    for pid in (mine | in_sessions) - {0, 1, os.getpid(), proc.pid}:
        _kill_if_the_jobs(pid, started, mine)


def _kill_if_the_jobs(pid: int, started: Started, mine: set[int]) -> None:
    """SIGKILL `pid` only while it is a process of the exec's node: in its PID namespace and of
    the rank's uid (sandboxed), or one of `mine`, the descendants of the worker's own exec
    (unsandboxed). Checked through a pidfd, so the process checked is the one signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if started.namespace is not None:
            if os.readlink(f"/proc/{pid}/ns/pid") != started.namespace or _uid_of(pid) != started.uid:
                return
        elif pid not in mine:
            return
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        return
    finally:
        os.close(pidfd)


def _uid_of(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text(errors="replace")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id), from /proc."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
            table[int(entry)] = (int(fields[1]), int(fields[3]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def _descendants(root: int, table: dict[int, tuple[int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
