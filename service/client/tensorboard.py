"""TensorBoard event files, written without TensorFlow, `tensorboard` or protobuf (contract §13).

An event file is a sequence of TFRecords: `u64 length`, `u32 masked_crc32c(length)`, the
bytes, `u32 masked_crc32c(bytes)`, all little-endian. Each record is one `Event` protobuf:
the first says `file_version: "brain.Event:2"`, the others carry a `Summary` of scalar values.
The few protobuf fields involved are encoded here by hand:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

TensorBoard reads any file whose name holds `tfevents`, one run per folder.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _CRC32C_POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # int64 as protobuf writes a negative one: ten bytes
    out = bytearray()
    while True:
        bits = n & 0x7F
        n >>= 7
        if n:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def scalar_value(tag: str, value: float) -> bytes:
    """A `Summary.Value` with a `simple_value`."""
    return _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value)


def event(
    wall_time: float, step: int | None = None, *, file_version: str | None = None, summary: bytes = b""
) -> bytes:
    out = _key(1, 1) + struct.pack("<d", wall_time)
    if step is not None:
        out += _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if summary:
        out += _bytes_field(5, summary)
    return out


def scalars_event(wall_time: float, step: int, values: Iterable[tuple[str, float]]) -> bytes:
    summary = b"".join(_bytes_field(1, scalar_value(tag, value)) for tag, value in values)
    return event(wall_time, step, summary=summary)


class EventFileWriter:
    """One event file in `logdir` (created), written at `close` (or the `with` block's end)."""

    def __init__(self, logdir: Path, wall_time: float | None = None) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time() if wall_time is None else wall_time
        self.path = logdir / f"events.out.tfevents.{int(now)}.{socket.gethostname() or 'torchjobs'}"
        self._records = [record(event(now, file_version="brain.Event:2"))]

    def add_scalars(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        if values:
            self._records.append(record(scalars_event(wall_time, step, sorted(values.items()))))

    def close(self) -> None:
        tmp = self.path.with_name("." + self.path.name + ".partial")
        tmp.write_bytes(b"".join(self._records))
        tmp.replace(self.path)

    def __enter__(self) -> EventFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
