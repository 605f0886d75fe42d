"""Storage on file:// and on s3:// (moto's server on loopback): writes are all or nothing."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from service.storage import Storage
from tests.service.checkpoints.conftest import BUCKET


@pytest.fixture(params=["file", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "file":
        return Storage(f"file://{tmp_path / 'root'}")
    options: dict[str, Any] = request.getfixturevalue("s3_server")
    return Storage(f"s3://{BUCKET}/unit-{uuid.uuid4().hex[:8]}", **options)


def test_writes_reads_and_deletes(storage: Storage, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 5)
    size, sha = storage.put_stream(iter([data[:1000], data[1000:]]), "jobs/1/a.pt")
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert storage.size("jobs/1/a.pt") == len(data) and storage.exists("jobs/1/a.pt")
    with storage.open("jobs/1/a.pt") as fh:
        fh.seek(1024 * 1024)
        assert fh.read(10) == data[1024 * 1024 : 1024 * 1024 + 10]
    assert storage.download_to("jobs/1/a.pt", str(tmp_path / "copy")) == sha

    local = tmp_path / "local.pt"
    local.write_bytes(b"uploaded")
    storage.put_local(str(local), "uploads/7/x-local.pt")
    assert storage.size("uploads/7/x-local.pt") == 8
    assert storage.put_file(str(tmp_path / "copy"), "jobs/1/b.pt") == (size, sha)
    assert storage.list() == ["jobs/1/a.pt", "jobs/1/b.pt", "uploads/7/x-local.pt"]
    storage.delete("jobs/1/a.pt")
    storage.delete("jobs/1/a.pt")  # deleting what is gone is fine
    assert storage.list("jobs") == ["jobs/1/b.pt"]


def test_a_failed_write_leaves_nothing(storage: Storage) -> None:
    def chunks() -> Any:
        yield b"x" * 1000
        raise ConnectionError("the source went away")

    with pytest.raises(ConnectionError):
        storage.put_stream(chunks(), "jobs/2/half.pt")
    with pytest.raises(OverflowError):
        storage.put_stream(iter([b"x" * 600, b"x" * 600]), "jobs/2/big.pt", max_bytes=1000)
    assert storage.list() == []


@pytest.mark.parametrize("key", ["", "/etc/passwd", "../x", "jobs/../../x"])
def test_keys_stay_under_the_root(key: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bad storage key"):
        Storage(f"file://{tmp_path}").path(key)
