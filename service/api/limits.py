"""Request body limits enforced before the body is read: a 100 MB POST costs us nothing.

A declared Content-Length over the limit is refused at once; a chunked body is counted as
it streams and cut off with 413 the moment it passes the limit.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, default_limit: int, upload_limits: dict[str, int]) -> None:
        """`upload_limits`: the paths whose body is a file, each with its own limit."""
        self.app, self.default_limit, self.upload_limits = app, default_limit, upload_limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_limits.get(scope["path"], self.default_limit)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _reply_413(send, limit)
            return
        body = _LimitedBody(receive, send, limit)
        try:
            await self.app(scope, body.receive, body.send)
        finally:
            if body.rejected and not body.started:
                await _reply_413(send, limit)


class _LimitedBody:
    """One request's receive and send, its body counted as it streams in against `limit`."""

    def __init__(self, receive: Receive, send: Send, limit: int) -> None:
        self._receive, self._send, self.limit = receive, send, limit
        self.seen = 0
        self.started = False
        self.rejected = False

    async def receive(self) -> Message:
        if self.rejected:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                # Tell the app the client went away, so it stops reading and cleans up;
                # anything it still tries to send is dropped, and the 413 goes out once
                # it has finished: by the time the client reads it, nothing is left.
                self.rejected = True
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.rejected:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reply_413(send: Send, limit: int) -> None:
    body = json.dumps({"detail": f"request body larger than {limit} bytes"}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
