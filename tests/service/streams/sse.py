"""Test-side Server-Sent Events: an async reader that keeps comments, a job runner, a proxy
that drops connections."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

from service.testing import harness
from service.testing.harness import auth, script_job  # noqa: F401 - the streams tests take them from here

STREAM_TIMEOUT = httpx.Timeout(10.0, read=120.0)


@dataclass
class Message:
    event: str
    id: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class Received:
    status: int
    messages: list[Message] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None

    @property
    def events(self) -> list[dict[str, Any]]:
        return [m.json() for m in self.messages]

    @property
    def seqs(self) -> list[int]:
        return [e["seq"] for e in self.events]


async def read_sse(
    client: httpx.AsyncClient,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    params: dict[str, Any] | None = None,
    stop_after_id: str | None = None,
) -> Received:
    """Read a stream to its end (or until the message with id `stop_after_id`, then hang up)."""
    async with client.stream("GET", path, headers=headers, params=params, timeout=STREAM_TIMEOUT) as resp:
        got = Received(status=resp.status_code, headers=dict(resp.headers))
        if resp.status_code != 200:
            await resp.aread()
            got.body = resp.json()
            return got
        data: list[str] = []
        event, event_id = "message", None
        async for line in resp.aiter_lines():
            if line == "":
                if data:
                    got.messages.append(Message(event, event_id, "\n".join(data)))
                    if stop_after_id is not None and event_id == stop_after_id:
                        return got
                data, event, event_id = [], "message", None
            elif line.startswith(":"):
                got.comments.append(line[1:].strip())
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "data":
                    data.append(value)
                elif name == "event":
                    event = value
                elif name == "id":
                    event_id = value
        return got


def is_terminal(event: dict[str, Any]) -> bool:
    return event["type"] == "state" and event["data"]["state"] in harness.TERMINAL


class DroppingProxy:
    """A TCP proxy to the server that cuts each of the first `drops` connections after it has
    passed `after_bytes` bytes from the server: a network that fails mid-stream."""

    def __init__(self, target_port: int, *, after_bytes: int, drops: int) -> None:
        self.target_port, self.after_bytes, self.drops_left = target_port, after_bytes, drops
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                limit = self.after_bytes if self.drops_left > 0 else None
                self.drops_left -= 1
            threading.Thread(target=self._serve, args=(conn, limit), daemon=True).start()

    def _serve(self, client: socket.socket, limit: int | None) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))

        def pump(src: socket.socket, dst: socket.socket, budget: int | None) -> None:
            passed = 0
            try:
                while data := src.recv(4096):
                    if budget is not None and passed + len(data) >= budget:
                        dst.sendall(data[: budget - passed])
                        with self._lock:
                            self.dropped += 1
                        break
                    dst.sendall(data)
                    passed += len(data)
            except OSError:
                pass
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pump, args=(client, upstream, None), daemon=True).start()
        pump(upstream, client, limit)
        client.close()
        upstream.close()

    def close(self) -> None:
        self.listener.close()
