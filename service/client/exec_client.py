"""Into a running job from the client (contract §14): exec, a shell and port forwarding over
the API's WebSockets, with the `websockets` library (which uvicorn's standard extras bring).

A refusal is the HTTP answer to the upgrade request: it becomes an ApiError, as any other
call's. Nothing here imports the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from service.client.errors import ApiError

CHUNK = 65536


@dataclass(frozen=True)
class ExecResult:
    output: bytes  # stdout and stderr, as they came
    exit_code: int


def socket_url(base: str, path: str, params: dict[str, Any]) -> str:
    base = base.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return f"{base}{path}?{urlencode(params)}"


@contextlib.contextmanager
def open_socket(url: str, token: str | None, path: str, params: dict[str, Any]) -> Iterator[ClientConnection]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        ws = connect(
            socket_url(url, path, params),
            additional_headers=headers,
            max_size=None,
            proxy=None,
            compression=None,
            open_timeout=60,
        )
    except InvalidStatus as exc:
        raise _api_error(exc) from None
    with ws:
        yield ws


def _api_error(exc: InvalidStatus) -> ApiError:
    response = exc.response
    try:
        detail = json.loads(response.body or b"").get("detail")
    except (ValueError, AttributeError):
        detail = (response.body or b"").decode(errors="replace")
    return ApiError(response.status_code, detail)


def exec_params(cmd: str, node_rank: int, local_rank: int, tty: bool) -> dict[str, Any]:
    return {"node_rank": node_rank, "local_rank": local_rank, "cmd": cmd, "tty": "true" if tty else "false"}


def run_exec(
    url: str,
    token: str | None,
    job_id: int,
    cmd: str,
    *,
    node_rank: int = 0,
    local_rank: int = 0,
    stdin: bytes = b"",
) -> ExecResult:
    """Run `cmd` in the rank's sandbox with `stdin`; its output and exit code."""
    params = exec_params(cmd, node_rank, local_rank, False)
    with open_socket(url, token, f"/v1/jobs/{job_id}/exec", params) as ws:
        for start in range(0, len(stdin), CHUNK):
            ws.send(stdin[start : start + CHUNK])
        ws.send(b"")
        output = bytearray()
        code = _receive(ws, output.extend)
    return ExecResult(bytes(output), code)


def _receive(ws: ClientConnection, out: Any) -> int:
    """Output to `out` until the exit code; -1 when the socket closed without one (the job
    ended, or the token was revoked)."""
    try:
        for message in ws:
            if isinstance(message, bytes):
                out(message)
            else:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    return int(json.loads(message)["exit_code"])
    except ConnectionClosed:
        pass
    return -1


def exec_streaming(
    url: str, token: str | None, job_id: int, cmd: str, node_rank: int, local_rank: int
) -> int:
    """`torchjobs exec`: local stdin (unless it is a terminal) to the command, its output to
    stdout; the remote exit code."""
    params = exec_params(cmd, node_rank, local_rank, False)
    with open_socket(url, token, f"/v1/jobs/{job_id}/exec", params) as ws:
        if sys.stdin is None or sys.stdin.isatty():
            ws.send(b"")
        else:
            threading.Thread(target=_pump_stdin, args=(ws, sys.stdin.fileno()), daemon=True).start()
        out = sys.stdout.buffer
        code = _receive(ws, lambda data: (out.write(data), out.flush()))
    return code


def _pump_stdin(ws: ClientConnection, fd: int, before: Callable[[], None] | None = None) -> None:
    """`before` runs ahead of each chunk sent (the shell's size check)."""
    with contextlib.suppress(OSError, ConnectionClosed):
        while data := os.read(fd, CHUNK):
            if before is not None:
                before()
            ws.send(data)
        ws.send(b"")


class _TerminalSize:
    """The local terminal's size, sent when it changed: by a thread of its own on SIGWINCH, and
    by the stdin pump before each keystroke it sends (so a line typed right after a resize
    never reaches the remote shell before the resize: its `stty size` would print the old one).

    The handler only writes a byte to a pipe. Sending from the handler itself, in the main
    thread, a burst of SIGWINCH (a window dragged) could run it again, nested, inside its own
    send, and wait for ever on the socket's lock that the outer send holds."""

    def __init__(self, ws: ClientConnection, fd: int) -> None:
        self.ws, self.fd = ws, fd
        self.sent: tuple[int, int] | None = None
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)

    def send_if_changed(self) -> None:
        with self.lock, contextlib.suppress(OSError, ConnectionClosed):
            cols, rows = os.get_terminal_size(self.fd)
            if (rows, cols) != self.sent:
                self.ws.send(json.dumps({"resize": [rows, cols]}))
                self.sent = (rows, cols)

    def on_sigwinch(self, *_: object) -> None:
        with contextlib.suppress(OSError):  # the pipe is full: a wake-up is pending already
            os.write(self.wake_w, b"w")

    def watch(self) -> None:
        """The resize thread: one look at the size per wake-up, until `close`."""
        try:
            while os.read(self.wake_r, 512):
                self.send_if_changed()
        finally:
            os.close(self.wake_r)

    def close(self) -> None:
        os.close(self.wake_w)  # the watcher reads the end of the pipe and ends


def shell(url: str, token: str | None, job_id: int, cmd: str, node_rank: int, local_rank: int) -> int:
    """`torchjobs shell`: a pty in the rank's sandbox, this terminal in raw mode (Ctrl-C goes
    there), its size sent at the start and on every SIGWINCH."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    interactive = os.isatty(fd)
    params = exec_params(cmd, node_rank, local_rank, True)
    with open_socket(url, token, f"/v1/jobs/{job_id}/exec", params) as ws:
        saved = termios.tcgetattr(fd) if interactive else None
        size = _TerminalSize(ws, fd) if interactive else None
        previous: Any = None
        try:
            if size is not None:
                tty.setraw(fd)
                size.send_if_changed()
                threading.Thread(target=size.watch, daemon=True).start()
                previous = signal.signal(signal.SIGWINCH, size.on_sigwinch)
            before = size.send_if_changed if size is not None else None
            threading.Thread(target=_pump_stdin, args=(ws, fd, before), daemon=True).start()
            out = sys.stdout.buffer
            code = _receive(ws, lambda data: (out.write(data), out.flush()))
        finally:
            if size is not None:
                signal.signal(signal.SIGWINCH, previous if previous is not None else signal.SIG_DFL)
                size.close()
            if saved is not None:
                termios.tcsetattr(fd, termios.TCSADRAIN, saved)
    return code


def parse_forward(spec: str) -> tuple[int, int]:
    """`[LOCAL:]REMOTE` -> (local, remote); LOCAL defaults to REMOTE."""
    local, _, remote = spec.rpartition(":")
    try:
        ports = (int(local or remote), int(remote))
    except ValueError:
        raise ValueError("expected [LOCAL:]REMOTE, two port numbers") from None
    if not all(0 <= p <= 65535 for p in ports) or ports[1] == 0:
        raise ValueError("ports are 1 to 65535 (LOCAL may be 0: any free port)")
    return ports


def forward(
    url: str, token: str | None, job_id: int, node_rank: int, local: int, remote: int, ready: Any = None
) -> None:
    """Listen on 127.0.0.1:LOCAL; each connection there is one to REMOTE inside the job
    (its own WebSocket), until Ctrl-C. `ready(port)` is told the port listened on."""
    listener = socket.create_server(("127.0.0.1", local))
    if ready is not None:
        ready(listener.getsockname()[1])
    with listener:
        while True:
            conn, _ = listener.accept()
            args = (conn, url, token, job_id, node_rank, remote)
            threading.Thread(target=_forward_one, args=args, daemon=True).start()


def _forward_one(
    conn: socket.socket, url: str, token: str | None, job_id: int, node_rank: int, port: int
) -> None:
    params = {"node_rank": node_rank, "port": port}
    with conn:
        try:
            with open_socket(url, token, f"/v1/jobs/{job_id}/forward", params) as ws:
                threading.Thread(target=_socket_to_ws, args=(conn, ws), daemon=True).start()
                with contextlib.suppress(ConnectionClosed, OSError):
                    for message in ws:
                        if isinstance(message, bytes):
                            conn.sendall(message)
        except ApiError as exc:
            print(f"forward: {exc.status_code}: {exc.detail}", file=sys.stderr)
        except OSError as exc:
            print(f"forward: {exc}", file=sys.stderr)


def _socket_to_ws(conn: socket.socket, ws: ClientConnection) -> None:
    with contextlib.suppress(OSError, ConnectionClosed):
        while True:
            select.select([conn], [], [])
            data = conn.recv(CHUNK)
            if not data:
                break
            ws.send(data)
    with contextlib.suppress(OSError, ConnectionClosed):
        ws.close()
