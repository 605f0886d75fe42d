"""Redis databases for test stacks, leased per test process.

Two stacks on one database would take each other's tasks (the queue is `worker.<name>`, and
every stack's worker is called `local` or `w1`). Under pytest-xdist each process leases only
from its own share of databases 1-11; 12-15 are fixed by the modules in conftest.FIXED_REDIS,
which xdist keeps in one process.
"""

from __future__ import annotations

from service.testing import harness


def pool(index: int, count: int) -> list[int]:
    """Process `index` of `count`'s share of databases 1-11."""
    return [db for db in range(1, 12) if (db - 1) % count == index]


_free = pool(*harness.xdist_process())


def fresh_redis_url() -> str:
    """A flushed database of this process's share, held until release_redis_url()."""
    import redis

    if not _free:
        raise RuntimeError("every Redis database of this test process is in use")
    url = f"{harness.REDIS_URL}/{_free.pop(0)}"
    redis.Redis.from_url(url).flushdb()
    return url


def release_redis_url(url: str) -> None:
    _free.append(int(url.rsplit("/", 1)[1]))
