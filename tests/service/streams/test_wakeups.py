"""The pieces under the streams, without a server: commit-time publishing to real Redis, the
hub's arm-then-wait rule, positions and UTF-8 cuts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from service.config import Settings
from service.errors import InvalidSpec
from service.streams.service import start_position, utf8_cut
from service.testing import harness
from service.wakeups.hub import WakeupHub
from service.wakeups.message import NOTIFY_EVENTS, channel_for, decode, mark_logs
from service.wakeups.publish import install_publisher

REDIS_DB = 13


def _messages(pubsub: redis.client.PubSub, wait_s: float = 0.5) -> list[tuple[list[int], list[int]]]:
    got, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
        if msg is not None:
            got.append(decode(msg["data"]))
    return got


def test_published_after_the_outer_commit_only_and_never_after_a_rollback(tmp_path: Path) -> None:
    url = f"{harness.REDIS_URL}/{REDIS_DB}"
    settings = Settings(home=tmp_path, broker_url=url)
    factory = sessionmaker(create_engine("sqlite://"))
    publisher = install_publisher(factory, settings)
    assert publisher is not None
    pubsub = redis.Redis.from_url(url).pubsub()
    pubsub.subscribe(channel_for(url))
    _messages(pubsub, 0.2)
    try:
        with factory() as session, session.begin():
            session.execute(text("select 1"))
            with session.begin_nested():
                session.info.setdefault(NOTIFY_EVENTS, set()).add(7)
            assert _messages(pubsub, 0.3) == []  # a released SAVEPOINT is not a commit
            mark_logs(session, 8)
        assert _messages(pubsub) == [([7], [8])]

        def a_wakeup_then_a_failure() -> None:
            with factory() as session, session.begin():
                session.info.setdefault(NOTIFY_EVENTS, set()).add(9)
                raise RuntimeError("rolled back")

        with pytest.raises(RuntimeError, match="rolled back"):
            a_wakeup_then_a_failure()
        with factory() as session, session.begin():
            session.execute(text("select 1"))  # commits with nothing to tell
        assert _messages(pubsub) == []
    finally:
        pubsub.close()
        publisher.close()


def test_no_publisher_without_redis(tmp_path: Path) -> None:
    factory = sessionmaker(create_engine("sqlite://"))
    assert install_publisher(factory, Settings(home=tmp_path, broker_url=None)) is None


def test_a_wake_up_between_arm_and_wait_is_not_lost() -> None:
    async def scenario() -> None:
        hub = WakeupHub()
        with hub.watch(1) as events, hub.watch(1, logs=True) as logs, hub.watch(2) as other:
            events.arm(), logs.arm(), other.arm()
            hub.wake(1)  # lands while the streams are still reading
            assert await events.wait(5) and await logs.wait(5)
            assert not await other.wait(0.01)
            events.arm(), logs.arm()
            hub.apply(b'{"e":[],"l":[1]}')  # log chunks wake log streams only
            assert await logs.wait(5) and not await events.wait(0.01)
            assert hub.watched() == ({1, 2}, {1})
        assert hub.open_watches == 0 and hub.watched() == (set(), set())

    asyncio.run(scenario())


def test_a_read_is_shared_only_by_streams_armed_before_no_later_wake_up() -> None:
    async def scenario() -> None:
        hub = WakeupHub()
        with hub.watch(1) as a, hub.watch(1) as b, hub.watch(1, logs=True) as c:
            read_began = a.arm()
            assert b.arm() == read_began  # nothing woke job 1 in between: b may share a's read
            hub.wake(1, logs_only=True)
            assert c.arm() == read_began  # new log chunks say nothing about events
            hub.wake(1)
            assert b.arm() > read_began  # b must read again: a's read may have missed it
        with hub.watch(1) as again:
            assert again.arm() > read_began  # watched anew: never an old version

    asyncio.run(scenario())


def test_resume_position_is_the_larger_of_after_and_last_event_id() -> None:
    assert start_position(0, None) == 0
    assert start_position(5, "3") == 5
    assert start_position(3, " 9 ") == 9
    for bad in ("-1", "abc", "1e3", "9" * 19):
        with pytest.raises(InvalidSpec):
            start_position(0, bad)


def test_utf8_cut_keeps_a_split_character_for_later() -> None:
    text_bytes = "ok é ✓ 𝄞".encode()
    assert utf8_cut(text_bytes) == len(text_bytes)
    for cut in range(len(text_bytes) + 1):
        head = text_bytes[:cut]
        head[: utf8_cut(head)].decode()  # never raises
        assert len(head) - utf8_cut(head) <= 3
    assert utf8_cut(b"\xff\xfe") == 2  # invalid bytes go out (replaced), they do not stall
