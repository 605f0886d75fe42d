"""The embedded broker's transport: messages appear whole under their final name, and an
unreadable one is skipped, not raised into the consumer."""

from __future__ import annotations

from pathlib import Path

import pytest
from kombu import Connection

from workers import broker_files


@pytest.fixture
def channel(tmp_path: Path):  # type: ignore[no-untyped-def]
    options = {"data_folder_in": str(tmp_path), "data_folder_out": str(tmp_path), "store_processed": False}
    with Connection(broker_files.register(), transport_options=options) as conn:
        yield conn.default_channel


def test_a_message_is_renamed_into_place_whole(channel, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    channel._put("worker.local", {"body": "x" * 100_000, "properties": {}})
    names = [p.name for p in tmp_path.iterdir()]
    assert len(names) == 1 and names[0].endswith(".worker.local.msg")
    assert not any(n.startswith(broker_files.STAGING_PREFIX) for n in names)
    assert channel._get("worker.local") == {"body": "x" * 100_000, "properties": {}}


def test_a_file_being_staged_is_not_a_message(channel, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / f"{broker_files.STAGING_PREFIX}abc").write_bytes(b'{"body": "half')
    assert channel._size("worker.local") == 0


@pytest.mark.parametrize("content", [b"", b'{"body": ', b"[]", b'{"body": "x"}', b"null"])
def test_an_unreadable_message_is_skipped_for_the_next_one(channel, tmp_path: Path, content: bytes) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "0_a.worker.local.msg").write_bytes(content)
    channel._put("worker.local", {"body": "next", "properties": {}})
    assert channel._get("worker.local") == {"body": "next", "properties": {}}
    assert list(tmp_path.iterdir()) == []


def test_the_embedded_app_uses_this_transport_and_polls_often(tmp_path: Path) -> None:
    """kombu's default is one look a second: up to a second from placement to launch."""
    from service.config import Settings
    from service.nodes.wire import EMBEDDED_POLL_S
    from workers.celery_app import make_celery

    with make_celery(Settings(home=tmp_path)).connection_for_write() as conn:
        transport = conn.transport
        assert isinstance(transport, broker_files.Transport)
        assert transport.polling_interval == EMBEDDED_POLL_S
