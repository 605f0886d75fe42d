"""The tar layout on its own (no app): many members whose headers alone pass the 1 MiB chunk
that literal bytes are gathered into, read whole and in ranges, against `tarfile`."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import anyio

from service.checkpoints.tar_stream import TarFile, archive_size, stream_range
from service.storage import Storage


def collect(storage: Storage, files: list[TarFile], start: int, end: int) -> bytes:
    async def run() -> bytes:
        return b"".join([chunk async for chunk in stream_range(storage, "many", files, start, end)])

    return anyio.run(run)


def test_thousands_of_members_in_ranges(tmp_path: Path) -> None:
    storage = Storage(f"file://{tmp_path / 'store'}")
    # 2500 members: 1.25 MiB of headers, a few bodies between them
    data = {f"f{i:05d}": os.urandom(1 + i % 600) if i % 100 == 0 else b"" for i in range(2500)}
    for path, body in data.items():
        if body:
            storage.put_stream(iter([body]), f"k/{path}")
    files = [TarFile(p, len(b), f"k/{p}") for p, b in data.items()]
    size = archive_size("many", files)
    whole = collect(storage, files, 0, size)
    assert len(whole) == size
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        seen = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert seen == {f"many/{p}": b for p, b in data.items()}
    mib = 1024 * 1024
    for start, end in ((0, 1), (mib - 3, mib + 3), (mib, size), (size - 1500, size - 1000), (777, 778)):
        assert collect(storage, files, start, end) == whole[start:end], (start, end)
