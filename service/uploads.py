"""Receiving a raw request body into a local file: constant memory, hashed as it lands.

Checkpoint uploads and code archives both arrive this way; what each then checks differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from service.errors import TooLarge
from service.storage import CHUNK


async def receive(
    chunks: AsyncIterator[bytes], path: Path, limit: int, what: str = "upload"
) -> tuple[int, str]:
    """Write the body to `path`, 1 MiB at a time from a worker thread; (size, sha256)."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray()
    fh = await anyio.to_thread.run_sync(open, path, "wb")
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the {what} is larger than {limit} bytes")
            buffer += chunk
            if len(buffer) >= CHUNK:
                data, buffer = buffer, bytearray()
                await anyio.to_thread.run_sync(_write, fh, digest, data)
        await anyio.to_thread.run_sync(_write, fh, digest, buffer, True)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(fh.close)
    return size, digest.hexdigest()


def sweep_partials(folder: Path, max_age_s: float = 3600.0) -> None:
    """Partial uploads a killed server left behind (an upload in flight elsewhere is younger)."""
    if not folder.is_dir():
        return
    now = time.time()
    for path in folder.glob("*.partial"):
        with contextlib.suppress(FileNotFoundError):
            if now - path.stat().st_mtime > max_age_s:
                path.unlink()


def _write(fh: Any, digest: Any, data: bytearray, last: bool = False) -> None:
    if data:
        digest.update(data)
        fh.write(data)
    if last:
        fh.flush()
        os.fsync(fh.fileno())
