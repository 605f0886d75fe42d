"""Request latency as a pure ASGI middleware, labelled by route template, not by raw path.

The route is read from the scope after routing (Starlette records the matched route there), so
``/v1/jobs/17`` and ``/v1/jobs/18`` are one series, ``/v1/jobs/{job_id}``; a request that matched
no route is ``<unmatched>``, which keeps the label set bounded whatever paths clients send.
An event stream is timed to its first byte: its whole life is how long a client watched.
"""

from __future__ import annotations

import time

from prometheus_client import Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "<unmatched>"


class RequestLatencyMiddleware:
    def __init__(self, app: ASGIApp, *, histogram: Histogram) -> None:
        self.app, self.histogram = app, histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        streaming = False
        observed = False

        def observe() -> None:
            nonlocal observed
            if not observed:
                observed = True
                self.histogram.labels(scope["method"], route_of(scope), str(status)).observe(
                    time.perf_counter() - start
                )

        async def timed_send(message: Message) -> None:
            nonlocal status, streaming
            if message["type"] == "http.response.start":
                status = int(message["status"])
                streaming = any(
                    k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                    for k, v in message.get("headers", ())
                )
                if streaming:
                    observe()
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            observe()


def route_of(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED
