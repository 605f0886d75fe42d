"""Checkpoint downloads that survive a dropped connection and prove their bytes.

Bytes land in `DEST.partial`; an existing partial file is continued with a `Range` request
(guarded by `If-Range` on the ETag, so a changed file restarts from zero); the SHA-256 of the
whole file is checked against the server's before the file is moved to DEST.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from service.client import Client

CHUNK = 1024 * 1024


class ChecksumMismatch(Exception):
    pass


def download_checkpoint(
    client: Client, ckpt_id: int, dest: str, progress: Any = None, attempts: int = 5
) -> str:
    meta = client.checkpoint(ckpt_id)
    partial = dest + ".partial"
    for attempt in range(attempts):
        try:
            _fetch(client, ckpt_id, partial, meta, progress)
            break
        except (httpx.TransportError, httpx.RemoteProtocolError):
            if attempt == attempts - 1:
                raise
            time.sleep(min(2**attempt * 0.2, 3))
    digest = _sha256(partial)
    if digest != meta["sha256"]:
        os.unlink(partial)
        raise ChecksumMismatch(f"checkpoint {ckpt_id}: got {digest}, expected {meta['sha256']}")
    os.replace(partial, dest)
    return digest


def _fetch(client: Client, ckpt_id: int, partial: str, meta: dict[str, Any], progress: Any) -> None:
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
    with client.http.stream(
        "GET", f"/v1/checkpoints/{ckpt_id}/download", headers=headers, timeout=None
    ) as resp:
        if resp.status_code not in (200, 206):
            resp.read()
            from service.client import _json

            _json(resp)
        mode = "ab" if resp.status_code == 206 else "wb"
        done = have if resp.status_code == 206 else 0
        with open(partial, mode) as out:
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
