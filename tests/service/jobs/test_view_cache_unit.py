"""The job-view cache's own rules, with a fake clock: what it stores, what it drops, for how long."""

from __future__ import annotations

from service.jobs.view_cache import CachedCaller, CachedView, ViewCache

VIEW = CachedView(owner_id=1, body=b'{"id": 7}')


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def enabled_cache(clock: Clock | None = None, **kwargs: int) -> ViewCache:
    cache = ViewCache(ttl_s=5.0, clock=clock or Clock(), **kwargs)
    cache.enable()
    return cache


def test_a_stored_view_is_served_until_it_expires() -> None:
    clock = Clock()
    cache = enabled_cache(clock)
    cache.store_view(7, VIEW, cache.generation)
    assert cache.view(7) == VIEW
    clock.now += 5.5
    assert cache.view(7) is None


def test_a_read_that_raced_an_invalidation_is_not_stored() -> None:
    cache = enabled_cache()
    before_read = cache.generation
    cache.invalidate_job(99)  # any commit seen while the read ran, even of another job
    cache.store_view(7, VIEW, before_read)
    cache.store_caller("h", CachedCaller(user_id=1, is_admin=False, name="u"), before_read)
    assert cache.view(7) is None and cache.caller("h") is None
    cache.store_view(7, VIEW, cache.generation)
    assert cache.view(7) == VIEW


def test_invalidation_drops_the_job_or_everything() -> None:
    cache = enabled_cache()
    cache.store_view(7, VIEW, cache.generation)
    cache.store_view(8, VIEW, cache.generation)
    cache.store_caller("h", CachedCaller(user_id=1, is_admin=True, name="u"), cache.generation)
    cache.invalidate_job(7)
    assert cache.view(7) is None and cache.view(8) == VIEW and cache.caller("h") is not None
    cache.invalidate_all()
    assert cache.view(8) is None and cache.caller("h") is None


def test_nothing_is_served_or_stored_while_disabled() -> None:
    cache = ViewCache(ttl_s=5.0)
    cache.store_view(7, VIEW, cache.generation)
    assert cache.view(7) is None
    cache.enable()
    cache.store_view(7, VIEW, cache.generation)
    cache.disable()
    assert cache.view(7) is None
    cache.enable()
    assert cache.view(7) is None  # re-enabling starts empty: changes may have been missed


def test_queued_views_are_never_stored() -> None:
    cache = enabled_cache()
    cache.store_view(7, CachedView(owner_id=1, body=b"{}", storable=False), cache.generation)
    assert cache.view(7) is None


def test_the_oldest_entry_makes_room() -> None:
    cache = enabled_cache(max_entries=2)
    for job_id in (1, 2, 3):
        cache.store_view(job_id, VIEW, cache.generation)
    assert cache.view(1) is None and cache.view(2) == VIEW and cache.view(3) == VIEW


def test_a_polled_feed_runs_before_each_look_up() -> None:
    cache = enabled_cache()
    cache.store_view(7, VIEW, cache.generation)
    cache.poll = cache.invalidate_all
    cache.refresh()
    assert cache.view(7) is None


def test_a_list_page_is_dropped_at_any_change_of_any_job() -> None:
    clock = Clock()
    cache = enabled_cache(clock)
    key = (None, "first page")
    cache.store_page(key, ([9, 8], None), cache.generation)
    assert cache.page(key) == ([9, 8], None)
    cache.invalidate_job(1)  # a job on no page of it: it may join one
    assert cache.page(key) is None
    stale = cache.generation
    cache.invalidate_job(2)
    cache.store_page(key, ([9, 8], None), stale)  # read before that change: not kept
    assert cache.page(key) is None
    cache.store_page(key, ([9, 8], None), cache.generation)
    clock.now += 5.5
    assert cache.page(key) is None  # expired
