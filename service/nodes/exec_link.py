"""The link between the API and a worker's exec endpoint (contract §14): its wire format and
its one row of state, shared by both sides (the worker reaches the control plane only here).

Why a direct connection at all: exec and forward need a live byte pipe, and the database and
Celery carry none. Each worker process listens on a TCP port of its own
(`TORCHJOBS_EXEC_BIND`), writes `ADDRESS:PORT` and a fresh random secret into its `workers`
row at start, and the API, once it has authorised the caller, connects there and relays. The
secret never leaves the database and the worker's memory: it is not in any environment or
file, so a job (whose code may reach that port on the host network) cannot speak here.

One connection, one session:

    worker -> API   b"TJX1 " + NONCE (64 hex digits) + b"\n"
    API -> worker   JSON {"request": {...}, "mac": HMAC-SHA256(secret, NONCE + request JSON)} + b"\n"
    worker -> API   JSON {"ok": true} | {"ok": false, "status": 400|404, "detail": "..."} + b"\n"
    then frames both ways: one byte of type, four of length (big-endian), the payload.

A fresh nonce per connection: a recorded request is worth nothing on another one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
from typing import Any

from sqlalchemy.orm import Session

from service.hosts import repository as hosts_repo

GREETING = b"TJX1 "
MAX_LINE = 256 * 1024  # a request line (argv, environment-free) is far smaller
MAX_FRAME = 1024 * 1024
HEADER = struct.Struct(">BI")

# frame types
DATA = 1  # API -> worker: stdin; worker -> API: output (stdout and stderr, or the forwarded bytes)
EOF = 2  # API -> worker: stdin is closed
RESIZE = 3  # API -> worker: JSON [rows, cols]
EXIT = 4  # worker -> API: JSON {"exit_code": N}; the last frame

OPS = ("exec", "forward")


def new_secret() -> str:
    return secrets.token_hex(32)


def new_nonce() -> str:
    return secrets.token_hex(32)


def request_bytes(request: dict[str, Any]) -> bytes:
    return json.dumps(request, sort_keys=True, separators=(",", ":")).encode()


def sign(secret: str, nonce: str, request: dict[str, Any]) -> str:
    return hmac.new(secret.encode(), nonce.encode() + request_bytes(request), hashlib.sha256).hexdigest()


def verified(secret: str, nonce: str, line: bytes) -> dict[str, Any] | None:
    """The request of an API line, if its MAC is the secret's over this nonce; else None."""
    try:
        message = json.loads(line)
        request, mac = message["request"], message["mac"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(request, dict) or not isinstance(mac, str):
        return None
    if not hmac.compare_digest(sign(secret, nonce, request), mac):
        return None
    return request


def signed_line(secret: str, nonce: str, request: dict[str, Any]) -> bytes:
    return json.dumps({"request": request, "mac": sign(secret, nonce, request)}).encode() + b"\n"


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def publish_endpoint(session: Session, name: str, session_id: str, address: str, secret: str) -> None:
    """The worker process's endpoint and secret, on its own row (a restart replaces both)."""
    hosts_repo.set_exec_endpoint(session, name, session_id, address, secret)
