"""Checkpoint downloads that survive a dropped connection and prove their bytes.

Bytes land in `DEST.partial`; an existing partial file is continued with a `Range` request
(guarded by `If-Range` on the ETag, so a changed file restarts from zero); the SHA-256 of the
whole file is checked against the server's before the file is moved to DEST. A resumed file
that fails the check (its kept bytes were not this file's) is fetched again whole, once.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import httpx

from service.client.errors import read_json

CHUNK = 1024 * 1024
TIMEOUT = httpx.Timeout(30.0, read=300.0)  # a stalled server is a dropped connection: retried


class ChecksumMismatch(Exception):
    pass


def download_checkpoint(
    http: httpx.Client,
    ckpt_id: int,
    meta: dict[str, Any],
    dest: str,
    progress: Any = None,
    attempts: int = 5,
) -> str:
    """Checkpoint `ckpt_id` (`meta`: its record, with `size_bytes` and `sha256`) into `dest`,
    through the API's `http` client; returns the verified SHA-256."""
    partial = dest + ".partial"
    resumed = os.path.exists(partial) and os.path.getsize(partial) > 0
    _fetch_with_retries(http, ckpt_id, partial, meta, progress, attempts)
    digest = _sha256(partial)
    if digest != meta["sha256"] and resumed:
        # The bytes kept from before were not this file's: start again from nothing, once.
        os.unlink(partial)
        _fetch_with_retries(http, ckpt_id, partial, meta, progress, attempts)
        digest = _sha256(partial)
    if digest != meta["sha256"]:
        os.unlink(partial)
        raise ChecksumMismatch(f"checkpoint {ckpt_id}: got {digest}, expected {meta['sha256']}")
    os.replace(partial, dest)
    return digest


def _fetch_with_retries(
    http: httpx.Client, ckpt_id: int, partial: str, meta: dict[str, Any], progress: Any, attempts: int
) -> None:
    for attempt in range(attempts):
        try:
            _fetch(http, ckpt_id, partial, meta, progress)
            return
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
            time.sleep(min(2**attempt * 0.2, 3))


def _fetch(http: httpx.Client, ckpt_id: int, partial: str, meta: dict[str, Any], progress: Any) -> None:
    have = os.path.getsize(partial) if os.path.exists(partial) else 0
    total = int(meta["size_bytes"])
    if have > total:
        os.unlink(partial)
        have = 0
    if progress is not None:
        progress(have, total)
    if have == total:
        return
    headers = {"Range": f"bytes={have}-", "If-Range": f'"{meta["sha256"]}"'} if have else {}
    with http.stream("GET", f"/v1/checkpoints/{ckpt_id}/download", headers=headers, timeout=TIMEOUT) as resp:
        if resp.status_code not in (200, 206):
            resp.read()
            read_json(resp)
        resumed = resp.status_code == 206 and resp.headers.get("Content-Range", "").startswith(
            f"bytes {have}-"
        )
        done = have if resumed else 0
        with open(partial, "ab" if resumed else "wb") as out:
            for chunk in resp.iter_bytes(CHUNK):
                out.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
