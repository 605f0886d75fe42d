"""The per-app registry and the collector that reads the database at scrape time.

Nothing is cached between scrapes: each scrape opens one short read-only transaction, so the numbers
are the database's, whichever API replica serves the scrape.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from service.db import Database
from service.hosts import service as hosts_service
from service.jobs.states import ALL_STATES
from service.jobs.view_cache import ViewCache
from service.metrics import repository as repo
from service.states import WorkerState
from service.usage.accounting import totals_by_owner

# Seconds a job waits in the queue: from "a free slot was there" to "a cluster was busy for hours".
QUEUE_WAIT_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
PASS_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Labels that name a user: a family with one in any sample is shown to the admin only (contract §7).
PER_USER_LABELS = frozenset({"user", "user_id", "owner", "owner_id"})
NOT_TAKING_WORK = ("quarantined", "draining", "drained")  # online, heartbeating, taking no new work


class DatabaseCollector(Collector):
    """Jobs by state, queue waits, and GPUs per worker, read from the database on every scrape."""

    def __init__(self, database: Callable[[], Database], clock: Callable[[], datetime] | None = None) -> None:
        self._database = database
        self._clock = clock or (lambda: datetime.now(UTC))

    def describe(self) -> Iterator[Metric]:
        # Declared empty so registering does not run a scrape (the database may not exist yet).
        return iter(())

    def collect(self) -> Iterator[Metric]:
        with self._database().read() as session:
            counts = repo.job_counts_by_state(session)
            waits = repo.queue_waits(session)
            oldest = repo.oldest_queued_since(session)
            used = repo.gpus_used_by_worker(session)
            workers = hosts_service.list_workers(session, None).items
            now = self._clock()
            gpu_seconds = totals_by_owner(session, now)
            names = repo.user_names(session)
            preemptions = repo.preempted_attempts(session)
            resizes = repo.preempted_attempts(session, "resized")

        jobs = GaugeMetricFamily("torchjobs_jobs", "Jobs in each state.", labels=["state"])
        for state in ALL_STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs

        by_user = CounterMetricFamily(
            "torchjobs_user_gpu_seconds",
            "GPU-seconds used by each user's jobs, every attempt, running ones up to now (contract §9).",
            labels=["user"],
        )
        for owner, seconds in sorted(gpu_seconds.items()):
            by_user.add_metric([names.get(owner, str(owner))], seconds)
        yield by_user

        yield queue_wait_histogram([(started - queued).total_seconds() for queued, started in waits])

        oldest_wait = GaugeMetricFamily(
            "torchjobs_queue_oldest_wait_seconds",
            "How long the longest-waiting queued job has waited (0 when the queue is empty).",
        )
        oldest_wait.add_metric([], max(0.0, (now - oldest).total_seconds()) if oldest else 0.0)
        yield oldest_wait

        total = GaugeMetricFamily(
            "torchjobs_worker_gpus", "GPUs (or CPU slots) a worker has.", labels=["worker"]
        )
        busy = GaugeMetricFamily(
            "torchjobs_worker_gpus_used", "GPUs of a worker held by jobs.", labels=["worker"]
        )
        free = GaugeMetricFamily(
            "torchjobs_worker_gpus_free",
            "GPUs of a worker free for new jobs (0 while the worker is offline).",
            labels=["worker"],
        )
        online = GaugeMetricFamily(
            "torchjobs_worker_online",
            "1 while the worker heartbeats, 0 once it is offline.",
            labels=["worker"],
        )
        drained = GaugeMetricFamily(
            "torchjobs_worker_draining",
            "1 while an admin's drain holds the worker: draining, or drained (contract §12).",
            labels=["worker"],
        )
        quarantined = GaugeMetricFamily(
            "torchjobs_worker_quarantined",
            "1 while the worker is quarantined: heartbeating, but taking no new work (contract §8).",
            labels=["worker"],
        )
        for w in workers:
            total.add_metric([w.name], w.gpus)
            busy.add_metric([w.name], used.get(w.name, 0))
            free.add_metric([w.name], w.gpus_free)
            online.add_metric([w.name], 1 if w.state in (WorkerState.ONLINE, *NOT_TAKING_WORK) else 0)
            quarantined.add_metric([w.name], 1 if w.state == "quarantined" else 0)
            drained.add_metric([w.name], 1 if w.state in ("draining", "drained") else 0)
        yield from (total, busy, free, online, quarantined, drained)
        preempted = CounterMetricFamily(
            "torchjobs_preemptions",
            "Attempts ended by a preemption or a drain, all time (contract §12).",
        )
        preempted.add_metric([], preemptions)
        yield preempted
        resized = CounterMetricFamily(
            "torchjobs_resizes", "Attempts of elastic jobs ended by a resize, all time (contract §12)."
        )
        resized.add_metric([], resizes)
        yield resized


def queue_wait_histogram(waits: Sequence[float]) -> HistogramMetricFamily:
    """A cumulative histogram of queue waits in seconds (a negative wait, from clock skew, counts as 0)."""
    counts = [0] * (len(QUEUE_WAIT_BUCKETS) + 1)
    total = 0.0
    for wait in waits:
        wait = max(0.0, wait)
        total += wait
        counts[bisect.bisect_left(QUEUE_WAIT_BUCKETS, wait)] += 1
    buckets, running = [], 0
    for bound, count in zip((*QUEUE_WAIT_BUCKETS, float("inf")), counts, strict=True):
        running += count
        buckets.append((floatToGoString(bound), running))
    family = HistogramMetricFamily(
        "torchjobs_job_queue_wait_seconds",
        "Time from entering the queue to running, per attempt that started (retries count again).",
    )
    family.add_metric([], buckets, sum_value=total)
    return family


class ViewCacheCollector(Collector):
    """This API process's job-view cache (service/jobs/view_cache.py): whether its change feed
    is up (0 means every GET of a job reads the database) and how often it answered."""

    def __init__(self, cache: Callable[[], ViewCache | None]) -> None:
        self._cache = cache

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        cache = self._cache()
        if cache is None:
            return
        enabled = GaugeMetricFamily(
            "torchjobs_job_view_cache_enabled",
            "1 while this process serves GET /v1/jobs/{id} from memory (its change feed is up).",
        )
        enabled.add_metric([], 1 if cache.enabled else 0)
        yield enabled
        for name, value, what in (("hits", cache.hits, "answered"), ("misses", cache.misses, "missed")):
            counter = CounterMetricFamily(
                f"torchjobs_job_view_cache_{name}", f"Look-ups (callers and views) the cache {what}."
            )
            counter.add_metric([], value)
            yield counter


def is_per_user(family: Metric) -> bool:
    """Whether a metric family has a series per user (a sample labelled with a user)."""
    return any(PER_USER_LABELS.intersection(sample.labels) for sample in family.samples)


class WithoutPerUser(Collector):
    """Another registry's families, less the per-user ones (`is_per_user`): what a scraper who
    is not the admin sees (contract §7: per-user figures are the admin's only)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        return (family for family in self._registry.collect() if not is_per_user(family))


class AppMetrics:
    """One app's registry: the request-latency histogram, the database collector and the
    job-view cache's counters; `shared_registry` is the same, less the per-user series, for
    every scraper but the admin."""

    def __init__(
        self, database: Callable[[], Database], view_cache: Callable[[], ViewCache | None] = lambda: None
    ) -> None:
        self.registry = CollectorRegistry()
        self.http_latency = Histogram(
            "torchjobs_http_request_duration_seconds",
            "HTTP request latency by route template (to the response's first byte for event streams).",
            ["method", "route", "status"],
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )
        self.scheduler_pass = Histogram(
            "torchjobs_scheduler_pass_seconds",
            "One scheduling pass of this process: reap, place, commit, and the sweeps' bookkeeping.",
            buckets=PASS_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(DatabaseCollector(database))
        self.registry.register(ViewCacheCollector(view_cache))
        self.shared_registry = CollectorRegistry(auto_describe=False)
        self.shared_registry.register(WithoutPerUser(self.registry))

    def registry_for(self, *, admin: bool) -> CollectorRegistry:
        return self.registry if admin else self.shared_registry
