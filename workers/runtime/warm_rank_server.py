"""The rank server: ranks forked from a process that has already imported torch and the
runtime, and taken the builtin trainer's first step once.

A rank's own start costs about 2.4 s of importing torch and, at its first optimizer step,
about 2 s more (the lazy import of `torch._dynamo`); a fork of a process that holds both costs
milliseconds. A warm spare sandbox's torchrun agent (warm_agent.py), which has imported torch
already, forks this server off itself (`serve_forked`): as the spare's uid, in the spare's
namespaces and, once a node takes the spare, in the node's control groups, it serves the ranks
of that one node and no other, and dies with it. `python -m workers.runtime.warm_rank_server
SOCKET` runs one alone (the tests), its stdin standing for the agent.

Each rank's warm_rank_client.py connects and sends its argv, environment, folder and
descriptors; the server forks, and the child becomes that rank as `python ARGV` would have
started it (warm_rank.py in the child). The server answers `pid N`, then `exit STATUS` when
the child ends. It declines (`cold`) where a warm rank could differ from a cold one: the job's
own packages or code could shadow a module the server has imported, or its environment does
not fit where /proc shows it (the worker finds ranks by their environment there).

The server reads one descriptor only for its end: the agent holds the pipe's write end, so
the server exits with the agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from workers.runtime import warm_rank

MAX_REQUEST = 1 << 20
FDS = 4  # stdin, stdout, stderr, the client's life pipe


class RankServer:
    def __init__(self, listener: socket.socket, life: int) -> None:
        self.listener, self.life = listener, life
        self.selector = selectors.DefaultSelector()
        self.waiting: dict[int, socket.socket] = {}  # child pid -> its client's connection
        self.lives: dict[int, int] = {}  # child pid -> its client's life pipe (EOF: kill it)
        self.wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up descriptor is what counts

    def serve(self) -> None:
        """Until the agent's end; then no new rank, but each rank still running is waited for
        and its exit told to its client (a rank told to stop by its client, whose torchrun
        died, still saves, as a cold rank would)."""
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "reap")
        self.selector.register(self.life, selectors.EVENT_READ, "life")
        closing = False
        while not (closing and not self.waiting):
            for key, _ in self.selector.select():
                if key.data == "life" and not os.read(self.life, 4096):
                    closing = True  # the agent that started this server has gone
                    self.selector.unregister(self.life)
                    self.selector.unregister(self.listener)
                    self.listener.close()
                elif key.data == "accept" and not closing:
                    self.accept()
                elif key.data == "reap":
                    self.reap()
                elif isinstance(key.data, int) and self.lives.get(key.data) == key.fd:
                    self.client_alive(key.data)

    def accept(self) -> None:
        try:
            accepted, _ = self.listener.accept()
        except OSError:
            return
        conn: socket.socket | None = accepted
        fds: list[int] = []
        try:
            accepted.settimeout(5.0)
            request, fds = receive(accepted)
            why = warm_rank.declines(request) if len(fds) == FDS else "not the descriptors a rank needs"
            if why is not None:
                print(f"torchjobs: a rank starts cold: {why}", file=sys.stderr, flush=True)
                accepted.sendall(b"cold\n")
                return
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                self._become_rank(request, fds, server)
            self.waiting[pid] = accepted
            conn = None
            self.watch_client(pid, fds.pop())
            print(f"torchjobs: a rank starts warm, forked as pid {pid}", file=sys.stderr, flush=True)
            accepted.sendall(f"pid {pid}\n".encode())
        except (OSError, ValueError):
            pass
        finally:
            for fd in fds:
                os.close(fd)
            if conn is not None:
                conn.close()

    def _become_rank(self, request: dict[str, object], fds: list[int], server: int) -> None:
        """In the child: let go of everything of the server's, then run the rank; never returns."""
        signal.set_wakeup_fd(-1)
        os.close(self.wakeup_r)
        os.close(self.life)
        self.selector.close()
        self.listener.close()
        for conn in self.waiting.values():
            conn.close()
        for life in self.lives.values():
            os.close(life)
        warm_rank.run(request, fds, server)

    def watch_client(self, pid: int, life: int) -> None:
        """The client holds the pipe's only write end: its end means torchrun killed it (or it
        died), and a cold rank would have been killed with its group. So is this one."""
        self.lives[pid] = life
        self.selector.register(life, selectors.EVENT_READ, pid)

    def client_alive(self, pid: int) -> None:
        life = self.lives[pid]
        try:
            if os.read(life, 4096):
                return
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # the rank leads its own session (warm_rank.run)
        self.forget_client(pid)

    def forget_client(self, pid: int) -> None:
        life = self.lives.pop(pid, None)
        if life is not None:
            self.selector.unregister(life)
            os.close(life)

    def reap(self) -> None:
        while True:
            try:
                os.read(self.wakeup_r, 4096)
            except BlockingIOError:
                break
        while self.waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.forget_client(pid)
            conn = self.waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"exit {status}\n".encode())
                conn.close()


def receive(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    """One request: an 8-byte length, the JSON, and the descriptors on its first bytes."""
    head, fds, _, _ = socket.recv_fds(conn, 8 + 65536, FDS + 1)
    if len(head) < 8:
        raise ValueError("short request")
    size = int.from_bytes(head[:8], "big")
    if size > MAX_REQUEST:
        raise ValueError("request too large")
    body = bytearray(head[8:])
    while len(body) < size:
        chunk = conn.recv(min(65536, size - len(body)))
        if not chunk:
            raise ValueError("request cut short")
        body += chunk
    request = json.loads(body)
    if not isinstance(request, dict):
        raise ValueError("not a request")
    return request, list(fds)


def serve(path: Path, life: int) -> None:
    """Preload, listen at `path`, serve until `life` ends."""
    preload_on_idle_cycles()
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    RankServer(listener, life).serve()


def preload_on_idle_cycles() -> None:
    """The preload (about 5 s of a core) on cycles no one else wants: a spare is made as a job
    ends, when the next may already be starting (cold, as the socket is not there yet), and on a
    CPU worker the cores are the slots its ranks train on. SCHED_IDLE is this thread's alone;
    ranks are forked by the main thread, whose policy stays the normal one."""
    failed: list[BaseException] = []

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        try:
            warm_rank.preload()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name="torchjobs-preload", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def serve_forked(path: Path, life: int, log: int) -> NoReturn:
    """In a child just forked from the warm agent: its own output (`log`, relayed by the agent),
    no stdin (the agent's launch line is the agent's), then `serve`; never returns."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        warm_rank.show_command([sys.executable, "-m", __name__, str(path)])
        serve(path, life)
        code = 0
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(code)


def main() -> int:
    serve(Path(sys.argv[1]), sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
