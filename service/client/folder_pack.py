"""A local checkpoint folder sent as a tar (contract §11: `POST /v1/checkpoints` with an
`application/x-tar` body), packed on the fly: no temporary copy of a many-gigabyte folder.

Its layout is the server's own (`service.checkpoints.tar_layout`): members `NAME/PATH` in
manifest order, fixed headers. So its length is known before it is sent (`Content-Length`), and
the folder uploaded is the checkpoint a later download gives back, byte for byte. Only regular
files are sent: links are neither followed nor sent (as a job's folder is taken), so a link to
somewhere else on this machine never leaves it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from service.checkpoints.manifest import path_key
from service.checkpoints.tar_layout import END, member_header, padding

CHUNK = 1024 * 1024


class FolderChanged(Exception):
    """A file changed size while the folder was being sent: the upload is abandoned."""


@dataclass(frozen=True)
class PackedFile:
    path: str  # relative, "/"-separated
    local: str
    size: int


def folder_files(root: str) -> list[PackedFile]:
    """Every regular file beneath `root` (links not followed), in manifest order."""
    found: list[PackedFile] = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for name in files:
            local = os.path.join(folder, name)
            info = os.lstat(local)
            if stat.S_ISREG(info.st_mode):
                rel = os.path.relpath(local, root).replace(os.sep, "/")
                found.append(PackedFile(rel, local, info.st_size))
    return sorted(found, key=lambda f: path_key(f.path))


def packed_size(name: str, files: list[PackedFile]) -> int:
    return sum(
        len(member_header(f"{name}/{f.path}", f.size)) + f.size + padding(f.size) for f in files
    ) + len(END)


def packed_chunks(name: str, files: list[PackedFile]) -> Iterator[bytes]:
    """The archive, a header or up to 1 MiB of a file at a time."""
    for f in files:
        yield member_header(f"{name}/{f.path}", f.size)
        sent = 0
        with open(f.local, "rb") as fh:
            while sent < f.size and (chunk := fh.read(min(CHUNK, f.size - sent))):
                sent += len(chunk)
                yield chunk
        if sent != f.size:
            raise FolderChanged(f"{f.local} changed while it was being sent ({sent} of {f.size} bytes)")
        yield b"\0" * padding(f.size)
    yield END
