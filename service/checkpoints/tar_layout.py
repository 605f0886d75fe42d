"""The bytes of a folder checkpoint's tar around its files' own (contract §11): member headers,
padding and the end, fixed so that the same folder is the same archive every time.

Standard library only: the server streams its downloads with it (`tar_stream`) and the client
(service/client, which runs without the server stack) packs a folder for upload with it.

- one member per file, `NAME/PATH`, a regular file: mode 0644, uid and gid 0, empty user and
  group names, mtime 0; no directory members;
- POSIX.1-2001 (pax) headers, written by `tarfile` with those fields: a plain ustar header when
  the name is ASCII and fits in 100 bytes and the size in 11 octal digits, else a pax header
  before it (`path`, `size`);
- each body padded with zeros to 512 bytes; two zero blocks end the archive (no padding to
  tar's 10 KiB record: readers do not need it, and the length stays the plain sum).
"""

from __future__ import annotations

import tarfile

BLOCK = tarfile.BLOCKSIZE
END = b"\0" * (2 * BLOCK)


def member_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def padding(size: int) -> int:
    """Zero bytes after a body of `size` bytes."""
    return -size % BLOCK
