"""Shared fixtures: real PostgreSQL databases, a real Redis database, real torchjobs stacks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.testing import harness

_redis_db = itertools.count(1)


@pytest.fixture
def pg_url() -> Iterator[str]:
    url = harness.create_pg_database()
    yield url
    harness.drop_pg_database(url)


@pytest.fixture(scope="module")
def module_pg_url() -> Iterator[str]:
    url = harness.create_pg_database()
    yield url
    harness.drop_pg_database(url)


def _fresh_redis_url() -> str:
    import redis

    db = 1 + next(_redis_db) % 10  # 1..10; 11-15 are fixed by test packages that need their own
    url = f"{harness.REDIS_URL}/{db}"
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def redis_url() -> str:
    return _fresh_redis_url()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Stack]:
    stack = harness.embedded_stack(Path(tmp_path_factory.mktemp("embedded")))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def production(tmp_path_factory: pytest.TempPathFactory, module_pg_url: str) -> Iterator[harness.Stack]:
    stack = harness.production_stack(
        Path(tmp_path_factory.mktemp("production")), module_pg_url, _fresh_redis_url()
    )
    yield stack
    stack.stop()
