"""A real HTTP receiver for webhook tests: a threaded server on 127.0.0.1 that records every
POST and answers what it is told to (500 for the first N calls, then 200, by default)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from service.testing.harness import free_port
from service.webhooks.signing import verify


@dataclass(frozen=True)
class Call:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def verifies(self, secret: str) -> bool:
        return verify(secret, self.body, self.headers.get("x-torchjobs-signature"))


class Receiver:
    def __init__(self, fail_first: int = 0, status: int = 200, location: str | None = None) -> None:
        self.port = free_port()
        self.fail_first, self.status, self.location = fail_first, status, location
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def _take(self, path: str, headers: dict[str, str], body: bytes) -> int:
        """Record one call and say what to answer it (decided and counted at once)."""
        with self._lock:
            status = 500 if len(self.calls) < self.fail_first else self.status
            self.calls.append(Call(path, headers, body, status))
            return status

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the stdlib's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                headers = {k.lower(): v for k, v in self.headers.items()}
                status = receiver._take(self.path, headers, body)
                self.send_response(status)
                if receiver.location and 300 <= status < 400:
                    self.send_header("Location", receiver.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Down: the port refuses connections until `start()` again (same port)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def delivered(self) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.ok]
