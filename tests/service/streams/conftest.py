"""The two real stacks of service/testing/harness.py, shared by this package's modules, with the stream
settings turned down so that tests see keep-alives in a second instead of fifteen.

On PostgreSQL + Redis the streams' own recheck timer is set far beyond any test's patience:
there, every event must arrive through the Redis wake-up path, or the test times out.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.testing import harness

STREAM_ENV = {"TORCHJOBS_SSE_PING_S": "1"}
REDIS_DB = 14


@pytest.fixture(scope="package")
def prod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Stack]:
    import redis

    home = Path(tmp_path_factory.mktemp("streams-production"))
    pg_url = harness.create_pg_database(migrated=True)
    redis_url = f"{harness.REDIS_URL}/{REDIS_DB}"
    redis.Redis.from_url(redis_url).flushdb()
    env = harness.make_env(
        home,
        TORCHJOBS_DATABASE_URL=pg_url,
        TORCHJOBS_BROKER_URL=redis_url,
        TORCHJOBS_STORAGE_URL=f"file://{home / 'shared-storage'}",
        TORCHJOBS_STREAM_RECHECK_S="600",
        **STREAM_ENV,
    )
    subprocess.run(harness.torchjobs_cmd("db", "upgrade"), env=env, check=True, capture_output=True)
    stack = harness.Stack(home=home, env=env, port=harness.free_port(), embedded=False)
    try:
        stack.start_server()
        stack.start_worker("w1", 2)
        yield stack
    finally:
        stack.stop()
        harness.drop_pg_database(pg_url)


@pytest.fixture(scope="package")
def emb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Stack]:
    home = Path(tmp_path_factory.mktemp("streams-embedded"))
    stack = harness.embedded_stack(home, harness.make_env(home, **STREAM_ENV))
    try:
        yield stack
    finally:
        stack.stop()
