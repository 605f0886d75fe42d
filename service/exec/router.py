"""`GET /v1/jobs/{id}/exec` and `GET /v1/jobs/{id}/forward` (contract §14): WebSockets.

Refusals (401, 404, 400, 429) are HTTP answers to the upgrade request (the WebSocket Denial
Response extension, which uvicorn carries), never a socket that opens and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocketDisconnect

from service.exec import service
from service.exec.service import Refusal, Target, WorkerLink
from service.nodes import exec_link

router = APIRouter(tags=["exec"])
REVOKED = 1008  # policy violation: the token no longer opens the job


@router.websocket("/v1/jobs/{job_id}/exec")
async def exec_socket(websocket: WebSocket, job_id: str) -> None:
    """A process in that rank's sandbox: binary messages are its stdin (an empty one closes
    it), its stdout and stderr come back as binary messages, then `{"exit_code": N}`."""
    await _session(websocket, job_id, "exec")


@router.websocket("/v1/jobs/{job_id}/forward")
async def forward_socket(websocket: WebSocket, job_id: str) -> None:
    """One TCP connection to `port`, opened inside the job's sandbox; binary messages both ways."""
    await _session(websocket, job_id, "forward")


def _token(websocket: WebSocket) -> str | None:
    scheme, _, value = websocket.headers.get("authorization", "").partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def _slots(websocket: WebSocket) -> service.Slots:
    state = websocket.app.state
    slots = getattr(state, "exec_slots", None)
    if slots is None:
        settings = state.settings
        slots = state.exec_slots = service.Slots(settings.exec_max_per_user, settings.exec_max_per_job)
    return slots


async def _session(websocket: WebSocket, job_id: str, op: str) -> None:
    db, settings = websocket.app.state.db, websocket.app.state.settings
    token = _token(websocket)
    try:
        target = await run_in_threadpool(
            service.authorise, db, token, job_id, op, dict(websocket.query_params)
        )
        with _slots(websocket).take(target):
            link = await service.connect(target, settings.exec_connect_timeout_s)
            try:
                await run_in_threadpool(service.record, db, target)
                await websocket.accept()
                code = await _relay(websocket, link, target, token, settings.stream_recheck_s)
            finally:
                await link.close(reset=target.op == "exec")
    except Refusal as refusal:
        await websocket.send_denial_response(JSONResponse({"detail": refusal.detail}, refusal.status))
        return
    with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
        await websocket.close(code)


async def _relay(
    websocket: WebSocket, link: WorkerLink, target: Target, token: str | None, recheck_s: float
) -> int:
    """Both directions and the token's re-check, until one of them ends; the close code."""
    tasks = {
        asyncio.create_task(_from_client(websocket, link, target.tty)): 1000,
        asyncio.create_task(_from_worker(websocket, link, target.op)): 1000,
        asyncio.create_task(_watch_token(websocket, token, target.job_id, recheck_s)): REVOKED,
    }
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    first = done.pop()
    with contextlib.suppress(Exception):
        first.result()
    return tasks[first]


MAX_STDIN_BACKLOG = 16 * 1024 * 1024  # unread stdin past this ends the session


async def _from_client(websocket: WebSocket, link: WorkerLink, tty: bool) -> None:
    """The client's messages to the worker. Received without waiting for the worker to take
    them (a pump sends them on): a command that reads no stdin must not stop this from seeing
    the client go, which ends the session (and the worker's side with it). A client that sends
    more than MAX_STDIN_BACKLOG the command has not read ends its own session."""
    backlog: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
    queued = [0]
    pump = asyncio.create_task(_pump(link, backlog, queued))
    try:
        while not pump.done():
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            for frame in _frames(message, tty):
                backlog.put_nowait(frame)
                queued[0] += len(frame[1])
            if queued[0] > MAX_STDIN_BACKLOG:
                return
        pump.result()  # the worker's link failed: said by the caller
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await pump


def _frames(message: Any, tty: bool) -> list[tuple[int, bytes]]:
    data = message.get("bytes")
    if data is not None:
        if not data:
            return [(exec_link.EOF, b"")]
        step = exec_link.MAX_FRAME
        return [(exec_link.DATA, data[i : i + step]) for i in range(0, len(data), step)]
    size = _resize(message.get("text"))
    return [(exec_link.RESIZE, json.dumps(size).encode())] if size is not None and tty else []


async def _pump(link: WorkerLink, backlog: asyncio.Queue[tuple[int, bytes]], queued: list[int]) -> None:
    while True:
        kind, payload = await backlog.get()
        await link.send(kind, payload)
        queued[0] -= len(payload)


def _resize(text: str | None) -> list[int] | None:
    """`{"resize": [ROWS, COLS]}`, each 1..10000; anything else is ignored."""
    try:
        value: Any = json.loads(text or "")
        rows, cols = value["resize"]
    except (ValueError, TypeError, KeyError):
        return None
    ok = all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 10_000 for v in (rows, cols))
    return [rows, cols] if ok else None


async def _from_worker(websocket: WebSocket, link: WorkerLink, op: str) -> None:
    while (got := await link.receive()) is not None:
        kind, payload = got
        if kind == exec_link.DATA:
            await websocket.send_bytes(payload)
        elif kind == exec_link.EXIT:
            if op == "exec":
                await websocket.send_text(payload.decode())
            return


async def _watch_token(websocket: WebSocket, token: str | None, job_id: int, recheck_s: float) -> None:
    db = websocket.app.state.db
    while True:
        await asyncio.sleep(recheck_s)
        with contextlib.suppress(Exception):  # the database away: the session goes on, asked again
            if not await run_in_threadpool(service.still_allowed, db, token, job_id):
                return
