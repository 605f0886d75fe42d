"""The TensorBoard event files `torchjobs tensorboard` writes, read back by an independent
reader written from the formats' definitions: TFRecord framing with masked CRC32C (checked
against the published CRC-32C check value), the `Event`/`Summary` protobuf fields, and a run
folder per job named by its sweep point."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from service.client.metric_commands import run_name, series_columns, unique_folder, write_run
from service.client.tensorboard import EventFileWriter, crc32c, masked_crc32c


def test_crc32c_check_values() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C (Castagnoli) check value
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert masked_crc32c(b"") == 0xA282EAD8


def read_records(path: Path) -> list[bytes]:
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        header = data[i : i + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[i + 8 : i + 12])[0] == masked_crc32c(header)
        body = data[i + 12 : i + 12 + length]
        assert struct.unpack("<I", data[i + 12 + length : i + 16 + length])[0] == masked_crc32c(body)
        out.append(body)
        i += 16 + length
    return out


def varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def fields(data: bytes) -> list[tuple[int, Any]]:
    """(field number, value) of a protobuf message: ints, doubles/floats as bytes, submessages."""
    out, i = [], 0
    while i < len(data):
        key, i = varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(data, i)
        elif wire == 1:
            value, i = data[i : i + 8], i + 8
        elif wire == 5:
            value, i = data[i : i + 4], i + 4
        else:
            assert wire == 2
            length, i = varint(data, i)
            value, i = data[i : i + length], i + length
        out.append((number, value))
    return out


def scalars(record: bytes) -> tuple[float, int, dict[str, float]]:
    got = dict(fields(record))
    wall = struct.unpack("<d", got[1])[0]
    values = {}
    for number, value in fields(got[5]):
        assert number == 1
        v = dict(fields(value))
        values[v[1].decode()] = struct.unpack("<f", v[2])[0]
    return wall, got[2], values


def test_a_run_reads_back(tmp_path: Path) -> None:
    series = [
        {"step": 10, "epoch": 0, "ts": "2026-12-04T10:00:00+00:00", "loss": 2.5},
        {"step": 20, "epoch": 1, "ts": "2026-12-04T10:00:01+00:00", "loss": 1.25, "val_loss": 1.5},
        {"step": None, "epoch": 1, "ts": "2026-12-04T10:00:02+00:00", "bleu": 30.0},
    ]
    assert write_run(tmp_path / "run", series) == 3
    (path,) = list((tmp_path / "run").iterdir())
    assert path.name.startswith("events.out.tfevents.")
    first, *rest = read_records(path)
    assert dict(fields(first))[3] == b"brain.Event:2"
    got = [scalars(r) for r in rest]
    assert [(step, values) for _, step, values in got] == [
        (10, {"loss": 2.5}),
        (20, {"loss": 1.25, "val_loss": 1.5}),
        (2, {"bleu": 30.0}),  # no step: its place in the series
    ]
    assert got[0][0] == 1796378400.0


def test_an_empty_run_and_negative_steps(tmp_path: Path) -> None:
    with EventFileWriter(tmp_path, wall_time=5.0) as writer:
        writer.add_scalars(-1, 6.0, {"x": 1.0})
        writer.add_scalars(3, 7.0, {})  # nothing: no record
    (path,) = list(tmp_path.iterdir())
    records = read_records(path)
    assert len(records) == 2
    assert scalars(records[1])[1] == 2**64 - 1  # int64 -1, as protobuf writes it


def test_run_names_and_columns() -> None:
    child = {"id": 7, "name": None, "sweep_point": {"hyperparameters.lr": 0.01, "hyperparameters.seed": 0}}
    assert run_name(child) == "lr=0.01,seed=0"
    assert run_name({"id": 3, "name": "a/b c", "sweep_point": None}) == "job-3-a_b_c"
    assert run_name({"id": 4, "sweep_point": {"x": "../.."}}) == "x=.._"  # never "..", never a hidden folder
    used: set[str] = set()
    assert [unique_folder("a", 1, used), unique_folder("a", 2, used)] == ["a", "a-job2"]
    got = {"names": ["loss", "val_loss"]}
    assert series_columns(got, None) == ["loss", "val_loss"]
    assert series_columns(got, "val_loss,nope,loss,val_loss") == ["val_loss", "loss"]
