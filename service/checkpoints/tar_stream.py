"""A folder checkpoint as one uncompressed tar, the same bytes every time (contract §11).

Every byte of the archive is a function of the checkpoint's name and its file rows (the layout
is `tar_layout`'s), so its length is known before a byte is read and any `Range` of it is
served by walking the members' offsets, never by building the archive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from service.checkpoints.service import read_range
from service.checkpoints.tar_layout import END, member_header, padding
from service.storage import CHUNK, Storage


@dataclass(frozen=True)
class TarFile:
    """What the archive needs of one file: where it goes and where its bytes are."""

    path: str
    size_bytes: int
    storage_key: str


@dataclass(frozen=True)
class Piece:
    """A run of the archive: literal bytes (a header, padding, the end) or a stored body."""

    size: int
    data: bytes | None = None
    key: str | None = None


def pieces(root: str, files: Sequence[TarFile]) -> Iterator[Piece]:
    """The archive front to back; `files` already in manifest order."""
    for f in files:
        header = member_header(f"{root}/{f.path}", f.size_bytes)
        yield Piece(size=len(header), data=header)
        if f.size_bytes:
            yield Piece(size=f.size_bytes, key=f.storage_key)
        pad = padding(f.size_bytes)
        if pad:
            yield Piece(size=pad, data=b"\0" * pad)
    yield Piece(size=len(END), data=END)


def archive_size(root: str, files: Sequence[TarFile]) -> int:
    return sum(p.size for p in pieces(root, files))


async def stream_range(
    storage: Storage, root: str, files: Sequence[TarFile], start: int, end: int
) -> AsyncIterator[bytes]:
    """Bytes [start, end) of the archive: headers made as they are reached, bodies read from
    storage a chunk at a time (`read_range`), so memory stays at about one chunk."""
    pos = 0
    pending = bytearray()
    for piece in pieces(root, files):
        lo, hi = pos, pos + piece.size
        pos = hi
        if hi <= start:
            continue
        if lo >= end:
            break
        first, last = max(start, lo) - lo, min(end, hi) - lo
        if piece.data is not None:
            pending += piece.data[first:last]
            if len(pending) >= CHUNK:
                yield bytes(pending)
                pending = bytearray()
            continue
        assert piece.key is not None
        if pending:
            yield bytes(pending)
            pending = bytearray()
        async for chunk in read_range(storage, piece.key, first, last):
            yield chunk
    if pending:
        yield bytes(pending)
