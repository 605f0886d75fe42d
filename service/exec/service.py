"""Into a running job (contract §14): who may, where it goes, and the relay.

The API authorises the caller (owner or admin, else `404` as every job read), checks the job
runs and the node and local rank exist (`400`), takes a slot under the per-user and per-job
limits (`429`), then opens a connection to the exec endpoint of the worker that runs that
node (workers/exec_endpoint.py, whose address and secret are on its `workers` row) and proves
itself there (service/nodes/exec_link.py). Every refusal, the worker's included, is an HTTP
answer to the upgrade request; only then is the WebSocket accepted and bytes relayed, on the
event loop (asyncio streams: no thread is held per session).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import socket
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from service.auth.tokens import user_for_token
from service.db import Database
from service.hosts import repository as hosts_repo
from service.jobs import repository as jobs_repo
from service.jobs.states import append_event
from service.models import Job, User, Worker
from service.nodes import exec_link
from service.schemas import MAX_ID
from service.states import JobState, NodeState

MAX_CMD = 16 * 1024
MAX_RANK = 100_000


class Refusal(Exception):
    """The HTTP answer to an upgrade request that is not granted."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclass(frozen=True, kw_only=True)
class Target:
    """One granted session: what runs, where, for whom."""

    op: str  # "exec" | "forward"
    job_id: int
    attempt: int
    node_rank: int
    local_rank: int
    user_id: int
    user_name: str
    argv: tuple[str, ...] = ()
    cmd: str = ""
    tty: bool = False
    port: int = 0
    worker_address: str = ""
    worker_secret: str = ""

    def request(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "node_rank": self.node_rank,
            "local_rank": self.local_rank,
            "argv": list(self.argv),
            "tty": self.tty,
            "port": self.port,
        }

    def event(self) -> tuple[str, dict[str, Any]]:
        if self.op == "exec":
            data = {"user": self.user_name, "node_rank": self.node_rank, "local_rank": self.local_rank}
            return "exec", {**data, "cmd": self.cmd}
        return "forward", {"user": self.user_name, "node_rank": self.node_rank, "port": self.port}


# --- who and what --------------------------------------------------------------------------


def _int(params: Mapping[str, str], name: str, default: int | None, lo: int, hi: int) -> int:
    raw = params.get(name, "")
    if raw == "" and default is not None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise Refusal(400, f"{name} must be an integer from {lo} to {hi}") from None
    if not lo <= value <= hi:
        raise Refusal(400, f"{name} must be an integer from {lo} to {hi}")
    return value


def _bool(params: Mapping[str, str], name: str) -> bool:
    raw = params.get(name, "").lower()
    if raw in ("", "false", "0", "no"):
        return False
    if raw in ("true", "1", "yes"):
        return True
    raise Refusal(400, f"{name} must be true or false")


def parse_cmd(cmd: str) -> tuple[str, ...]:
    """`cmd` as a POSIX shell splits it (contract §14)."""
    if not cmd.strip():
        raise Refusal(400, "cmd is required: the command line to run")
    if len(cmd) > MAX_CMD or "\0" in cmd or any(0xD800 <= ord(c) <= 0xDFFF for c in cmd):
        raise Refusal(400, f"cmd must be at most {MAX_CMD} characters, without NUL")
    try:
        argv = tuple(shlex.split(cmd))
    except ValueError as exc:
        raise Refusal(400, f"cmd: {exc}") from None
    if not argv:
        raise Refusal(400, "cmd is required: the command line to run")
    return argv


def caller(session: Session, token: str | None) -> User:
    user = user_for_token(session, token) if token else None
    if user is None:
        raise Refusal(401, "missing or invalid token")
    return user


def job_of(session: Session, user: User, raw_id: str) -> Job:
    try:
        job_id = int(raw_id)
    except ValueError:
        raise Refusal(404, "job not found") from None
    job = (
        jobs_repo.get_job(session, job_id, None if user.is_admin else user.id)
        if 1 <= job_id <= MAX_ID
        else None
    )
    if job is None:
        raise Refusal(404, "job not found")
    return job


def authorise(db: Database, token: str | None, raw_id: str, op: str, params: Mapping[str, str]) -> Target:
    """The session the caller asks for, or the Refusal that answers them (one short read)."""
    with db.read() as session:
        user = caller(session, token)
        job = job_of(session, user, raw_id)
        node_rank = _int(params, "node_rank", 0, 0, MAX_RANK)
        local_rank = _int(params, "local_rank", 0, 0, MAX_RANK) if op == "exec" else 0
        extra: dict[str, Any] = {}
        if op == "exec":
            cmd = params.get("cmd", "")
            extra = {"argv": parse_cmd(cmd), "cmd": cmd, "tty": _bool(params, "tty")}
        else:
            extra = {"port": _int(params, "port", None, 1, 65535)}
        if job.state != JobState.RUNNING:
            raise Refusal(400, f"job {job.id} is not running (it is {job.state})")
        if node_rank >= job.nodes:
            raise Refusal(400, f"job {job.id} has {job.nodes} node(s): no node_rank {node_rank}")
        per_node = job.gpus_per_node if job.mode in ("ddp", "fsdp") else 1
        if local_rank >= per_node:
            raise Refusal(400, f"a node of job {job.id} runs {per_node} rank(s): no local_rank {local_rank}")
        worker = _worker_of(session, job, node_rank)
        return Target(
            op=op,
            job_id=job.id,
            attempt=job.attempt,
            node_rank=node_rank,
            local_rank=local_rank,
            user_id=user.id,
            user_name=user.name,
            worker_address=worker.exec_address or "",
            worker_secret=worker.exec_secret or "",
            **extra,
        )


def _worker_of(session: Session, job: Job, node_rank: int) -> Worker:
    run = jobs_repo.node_run(session, job.id, job.attempt, node_rank)
    if run is None or run.state != NodeState.RUNNING:
        raise Refusal(400, f"node {node_rank} of job {job.id} is not running yet")
    worker = hosts_repo.worker(session, run.worker_name)
    if worker is None or not worker.exec_address or not worker.exec_secret:
        raise Refusal(400, f"the worker of node {node_rank} has no exec endpoint (see its log)")
    return worker


def still_allowed(db: Database, token: str | None, job_id: int) -> bool:
    """The token still opens the job: a revoked one ends its sessions (as streams)."""
    with db.read() as session:
        user = user_for_token(session, token) if token else None
        return (
            user is not None
            and jobs_repo.get_job(session, job_id, None if user.is_admin else user.id) is not None
        )


def record(db: Database, target: Target) -> None:
    """Each session is an event of the job: who, and what."""
    type_, data = target.event()
    with db.transaction() as session:
        append_event(session, target.job_id, type_, data)


# --- limits ----------------------------------------------------------------------------------


class Slots:
    """Sessions open at once in this API process, per user and per job (past either: 429)."""

    def __init__(self, per_user: int, per_job: int) -> None:
        self.per_user, self.per_job = per_user, per_job
        self.users: Counter[int] = Counter()
        self.jobs: Counter[int] = Counter()

    @contextlib.contextmanager
    def take(self, target: Target) -> Iterator[None]:
        if self.users[target.user_id] >= self.per_user:
            raise Refusal(429, f"you have {self.per_user} exec or forward sessions open already")
        if self.jobs[target.job_id] >= self.per_job:
            raise Refusal(
                429, f"job {target.job_id} has {self.per_job} exec or forward sessions open already"
            )
        self.users[target.user_id] += 1
        self.jobs[target.job_id] += 1
        try:
            yield
        finally:
            self.users[target.user_id] -= 1
            self.jobs[target.job_id] -= 1


# --- the worker's end ----------------------------------------------------------------------------


@dataclass
class WorkerLink:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def send(self, kind: int, payload: bytes = b"") -> None:
        self.writer.write(exec_link.frame(kind, payload))
        await self.writer.drain()

    async def receive(self) -> tuple[int, bytes] | None:
        """The next frame; None when the worker closed the connection."""
        try:
            header = await self.reader.readexactly(exec_link.HEADER.size)
            kind, size = exec_link.HEADER.unpack(header)
            if size > exec_link.MAX_FRAME:
                return None
            return kind, await self.reader.readexactly(size)
        except (asyncio.IncompleteReadError, OSError):
            return None

    async def close(self, *, reset: bool = False) -> None:
        """With `reset`, an RST at once, dropping whatever is still in flight to the worker:
        an exec session's end (the worker ends its side on seeing the close, so those bytes
        have no reader). A graceful close sends its FIN behind the bytes in the socket
        buffers; while the command reads no stdin the worker's window stays shut and that FIN
        never arrives, so the worker's side (its process, a thread) outlived the client.
        Otherwise what is in flight goes first, for up to CLOSE_GRACE_S, then the reset."""
        if reset:
            _reset(self.writer)
            return
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), CLOSE_GRACE_S)
        except (OSError, TimeoutError):
            _reset(self.writer)


CLOSE_GRACE_S = 5.0


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST now, dropping what was not sent (SO_LINGER 0)."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def connect(target: Target, timeout_s: float) -> WorkerLink:
    """The worker's endpoint, the handshake done, the session started there; a Refusal when
    it cannot be reached or says no."""
    try:
        host, port = _split_address(target.worker_address)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=exec_link.MAX_LINE), timeout_s
        )
    except (TimeoutError, OSError, ValueError) as exc:
        raise Refusal(
            400, f"the worker of node {target.node_rank} cannot be reached ({type(exc).__name__})"
        ) from None
    link = WorkerLink(reader, writer)
    try:
        greeting = await asyncio.wait_for(reader.readline(), timeout_s)
        if not greeting.startswith(exec_link.GREETING) or not greeting.endswith(b"\n"):
            raise Refusal(400, f"the worker of node {target.node_rank} did not answer as one")
        nonce = greeting[len(exec_link.GREETING) : -1].decode()
        writer.write(exec_link.signed_line(target.worker_secret, nonce, target.request()))
        await writer.drain()
        # a forward answers once the port inside is reached: the worker waits up to 15 s for it
        line = await asyncio.wait_for(reader.readline(), timeout_s + 20)
        answer = json.loads(line) if line else {"ok": False, "detail": "the worker hung up"}
    except (TimeoutError, OSError, ValueError, UnicodeDecodeError):
        await link.close()
        raise Refusal(400, f"the worker of node {target.node_rank} did not answer") from None
    except Refusal:
        await link.close()
        raise
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        await link.close()
        detail = answer.get("detail") if isinstance(answer, dict) else None
        raise Refusal(400, str(detail or "the worker refused"))
    return link
