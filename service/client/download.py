"""Checkpoint downloads that survive a dropped connection and prove their bytes.

Bytes land in `DEST.partial`; an existing partial file is continued with a `Range` request
(guarded by `If-Range` on the ETag, so a changed file restarts from zero); the SHA-256 of the
whole file is checked against the server's before the file is moved to DEST. A resumed file
that fails the check (its kept bytes were not this file's) is fetched again whole, once.

A folder checkpoint (contract §11) is fetched the same way file by file, from its listing, into
`DIR/NAME/PATH`: the listing's manifest must hash to the checkpoint's `sha256` before anything
is written, every listed path must stay inside `DIR/NAME`, a file already there with the
listed SHA-256 is kept, and every other file is resumed or fetched and then verified.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any
from urllib.parse import quote

import httpx

from service.checkpoints.manifest import ManifestEntry, folder_name, manifest_sha256, unsafe_path_reason
from service.client.errors import read_json

CHUNK = 1024 * 1024
TIMEOUT = httpx.Timeout(30.0, read=300.0)  # a stalled server is a dropped connection: retried


class ChecksumMismatch(Exception):
    pass


class UnsafeListing(Exception):
    """The server listed a path that would land outside the download's folder."""


def download_checkpoint(
    http: httpx.Client,
    ckpt_id: int,
    meta: dict[str, Any],
    dest: str,
    progress: Any = None,
    attempts: int = 5,
) -> str:
    """Checkpoint `ckpt_id` (`meta`: its record, with `size_bytes` and `sha256`) into `dest`,
    through the API's `http` client; returns the verified SHA-256. A folder checkpoint goes
    into the folder `dest` (`download_folder`)."""
    if meta.get("kind") == "folder":
        return download_folder(http, ckpt_id, meta, dest, progress, attempts)
    url = f"/v1/checkpoints/{ckpt_id}/download"
    return fetch_verified(http, url, dest, int(meta["size_bytes"]), meta["sha256"], progress, attempts)


def folder_destination(ckpt_id: int, meta: dict[str, Any], dest_dir: str) -> str:
    """Where a folder checkpoint lands: `dest_dir/NAME`."""
    return os.path.join(dest_dir, folder_name(str(meta["name"]), ckpt_id))


def download_folder(
    http: httpx.Client,
    ckpt_id: int,
    meta: dict[str, Any],
    dest_dir: str,
    progress: Any = None,
    attempts: int = 5,
) -> str:
    """A folder checkpoint into `dest_dir/NAME/…`, file by file; returns the verified manifest
    SHA-256. `progress(done, total)` counts bytes over the whole folder."""
    items = read_json(http.get(f"/v1/checkpoints/{ckpt_id}/files", timeout=TIMEOUT))["items"]
    entries = [ManifestEntry(str(i["path"]), int(i["size_bytes"]), str(i["sha256"])) for i in items]
    for entry in entries:
        reason = unsafe_path_reason(entry.path)
        if reason is not None:
            raise UnsafeListing(f"checkpoint {ckpt_id}: refusing {entry.path!r}: {reason}")
    listed = manifest_sha256(entries)
    if listed != meta["sha256"]:
        raise ChecksumMismatch(
            f"checkpoint {ckpt_id}: its file list hashes to {listed}, expected {meta['sha256']}"
        )
    root = folder_destination(ckpt_id, meta, dest_dir)
    total, before = sum(e.size_bytes for e in entries), 0
    for entry in entries:
        target = _inside(root, entry.path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        step = None if progress is None else _offset_progress(progress, before, total)
        if not _already_there(target, entry):
            url = f"/v1/checkpoints/{ckpt_id}/files/{quote(entry.path, safe='/')}"
            fetch_verified(http, url, target, entry.size_bytes, entry.sha256, step, attempts)
        before += entry.size_bytes
        if progress is not None:
            progress(before, total)
    return listed


def _inside(root: str, path: str) -> str:
    """`root/path`, refused when a link already on disk would take it outside `root`."""
    target = os.path.join(root, *path.split("/"))
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(target)]) != real_root:
        raise UnsafeListing(f"{path!r} would be written outside {root} (through a link on disk)")
    return target


def _already_there(target: str, entry: ManifestEntry) -> bool:
    return (
        os.path.isfile(target)
        and not os.path.islink(target)
        and os.path.getsize(target) == entry.size_bytes
        and _sha256(target) == entry.sha256
    )


def _offset_progress(progress: Any, before: int, total: int) -> Any:
    return lambda done, _size: progress(before + done, total)


def fetch_verified(
    http: httpx.Client,
    url: str,
    dest: str,
    size: int,
    sha256: str,
    progress: Any = None,
    attempts: int = 5,
) -> str:
    """The bytes at `url` (`size` long, `sha256` their hash, also their ETag) into `dest`,
    resumed from `dest.partial` and verified; returns the SHA-256."""
    partial = dest + ".partial"
    resumed = os.path.exists(partial) and os.path.getsize(partial) > 0
    _fetch_with_retries(http, url, partial, size, sha256, progress, attempts)
    digest = _sha256(partial)
    if digest != sha256 and resumed:
        # The bytes kept from before were not this file's: start again from nothing, once.
        os.unlink(partial)
        _fetch_with_retries(http, url, partial, size, sha256, progress, attempts)
        digest = _sha256(partial)
    if digest != sha256:
        os.unlink(partial)
        raise ChecksumMismatch(f"{url}: got {digest}, expected {sha256}")
    os.replace(partial, dest)
    return digest


def _fetch_with_retries(
    http: httpx.Client, url: str, partial: str, size: int, sha256: str, progress: Any, attempts: int
) -> None:
    for attempt in range(attempts):
        try:
            _fetch(http, url, partial, size, sha256, progress)
            return
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
            time.sleep(min(2**attempt * 0.2, 3))


def _fetch(http: httpx.Client, url: str, partial: str, total: int, sha256: str, progress: Any) -> None:
    have = os.path.getsize(partial) if os.path.exists(partial) else 0
    if have > total:
        os.unlink(partial)
        have = 0
    if progress is not None:
        progress(have, total)
    if have == total:
        if not os.path.exists(partial):
            open(partial, "wb").close()  # an empty file: nothing to fetch
        return
    headers = {"Range": f"bytes={have}-", "If-Range": f'"{sha256}"'} if have else {}
    with http.stream("GET", url, headers=headers, timeout=TIMEOUT) as resp:
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
