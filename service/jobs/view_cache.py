"""The API process's cache of rendered job views and of callers, for `GET /v1/jobs/{id}`.

Every client polls that route; each answer from the database costs five queries (the caller,
the job, its node runs, attempts and newest checkpoint), about 4 ms of CPU on a small machine.
A cache hit costs a dictionary look-up on the event loop.

The cache is only ever used while a change feed keeps it honest (`service.jobs.view_feed`):
PostgreSQL's LISTEN/NOTIFY, fed by triggers on every table the view reads, or SQLite's
`PRAGMA data_version`. While no feed runs the cache is off (`enabled` is False) and every
GET reads the database, as before. Commits made by this process invalidate everything at once
(`invalidate_all`), so whoever wrote reads their own write on the next request.

A view filled from a read that began before an invalidation is dropped, never stored
(`generation`): otherwise a read that raced a commit could put the old state back after the
commit's invalidation. Queued jobs are never stored: their queue position moves with others.
The ids of list pages are kept too, and dropped at any change of any job (an insert included:
PostgreSQL's feed has a trigger for new jobs, migration 0011).
Entries also expire after `ttl_s`, which bounds the damage of any change the feed missed.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")
# session.info: the transaction wrote something; its commit clears the cache (view_feed.py). Set
# by the commit hooks for ORM writes, and by writers that go through the connection directly.
WROTE = "view_cache_wrote"
# (the owner whose jobs a page lists, None for every owner's; the query: `ListQuery`)
PageKey = tuple[int | None, Hashable]
Page = tuple[list[int], str | None]  # a list page's job ids, and the next page's cursor


@dataclass(frozen=True, slots=True)
class CachedCaller:
    """What the job route needs to know of the bearer of a token."""

    user_id: int
    is_admin: bool
    name: str

    @property
    def id(self) -> int:
        """As `User.id`: a list page's views name the caller's own jobs' owner without a query."""
        return self.user_id


@dataclass(frozen=True, slots=True)
class CachedView:
    owner_id: int
    body: bytes
    storable: bool = True  # False for a queued job: its queue position moves with other jobs


class ViewCache:
    """Thread-safe: invalidations come from the commit hooks of any thread; look-ups and
    stores from the event loop."""

    def __init__(
        self,
        ttl_s: float,
        max_entries: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._views: dict[int, tuple[float, CachedView]] = {}
        self._callers: dict[str, tuple[float, CachedCaller]] = {}
        self._pages: dict[PageKey, tuple[float, Page]] = {}
        self._lock = threading.Lock()
        self._generations = itertools.count(1)
        self._generation = next(self._generations)
        self.enabled = False
        self.hits = self.misses = 0
        # A change feed that is asked rather than pushed (SQLite's data version): called
        # before every look-up, it invalidates what changed since the last one.
        self.poll: Callable[[], None] | None = None
        # (caller's token hash, job id) -> (generation, the database read under way), for
        # `service.jobs.cached_reads`; event loop only.
        self.reads_in_flight: dict[tuple[str, int], tuple[int, Any]] = {}
        # the missing jobs of a list page -> (generation, their render under way); event loop only
        self.renders_in_flight: dict[tuple[int, ...], tuple[int, Any]] = {}

    @property
    def generation(self) -> int:
        """Take it before reading the database; hand it to `store_*` with what was read."""
        return self._generation

    def refresh(self) -> None:
        """Catch up with the database before a look-up (a no-op for pushed feeds)."""
        if self.enabled and self.poll is not None:
            self.poll()

    def view(self, job_id: int) -> CachedView | None:
        return self._fresh(self._views, job_id)

    def caller(self, token_hash: str) -> CachedCaller | None:
        return self._fresh(self._callers, token_hash)

    def page(self, key: PageKey) -> Page | None:
        return self._fresh(self._pages, key)

    def store_page(self, key: PageKey, page: Page, generation: int) -> None:
        self._store(self._pages, key, page, generation)

    def store_view(self, job_id: int, view: CachedView, generation: int) -> None:
        if view.storable:
            self._store(self._views, job_id, view, generation)

    def store_caller(self, token_hash: str, caller: CachedCaller, generation: int) -> None:
        self._store(self._callers, token_hash, caller, generation)

    def invalidate_job(self, job_id: int) -> None:
        with self._lock:
            self._generation = next(self._generations)
            self._views.pop(job_id, None)
            self._pages.clear()  # any change may move any job into or out of any page

    def invalidate_all(self) -> None:
        with self._lock:
            self._generation = next(self._generations)
            self._views.clear()
            self._callers.clear()
            self._pages.clear()

    def enable(self) -> None:
        """The feed is (again) listening: whatever changed while it was not is unknown."""
        self.invalidate_all()
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False
        self.invalidate_all()

    def _fresh(self, entries: dict[K, tuple[float, V]], key: K) -> V | None:
        if not self.enabled:
            return None
        entry = entries.get(key)
        if entry is None or entry[0] < self._clock():
            self.misses += 1
            return None
        self.hits += 1
        return entry[1]

    def _store(self, entries: dict[K, tuple[float, V]], key: K, value: V, generation: int) -> None:
        with self._lock:
            if not self.enabled or generation != self._generation:
                return  # something changed while this was being read: it may be stale already
            if len(entries) >= self.max_entries and key not in entries:
                entries.pop(next(iter(entries)))  # the oldest stored
            entries[key] = (self._clock() + self.ttl_s, value)
