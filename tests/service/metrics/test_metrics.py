"""`GET /metrics`: the app's own registry, read from a real PostgreSQL at scrape time.

The app runs in-process (no scheduler thread); the jobs get their states the way production
does it: submitted through the API, placed by a real scheduler pass, started and retried through
the lifecycle functions a worker calls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from service import migrate
from service.app import create_app
from service.config import Settings
from service.hosts import states as host_states
from service.jobs import lifecycle
from service.jobs.states import ALL_STATES
from service.metrics import repository as metrics_repo
from service.metrics.collector import QUEUE_WAIT_BUCKETS, queue_wait_histogram
from service.models import utcnow
from service.scheduler.placement_pass import run_pass
from service.testing.harness import ADMIN_TOKEN

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BUILTIN = {"kind": "builtin", "model": "mlp", "dataset": "synthetic"}


def settings_for(pg_url: str, home: Path, **extra: object) -> Settings:
    return Settings(home=home, database_url=pg_url, admin_token=ADMIN_TOKEN, **extra)


@pytest.fixture
def settings(pg_url: str, tmp_path: Path) -> Settings:
    settings = settings_for(pg_url, tmp_path)
    migrate.upgrade(settings)
    return settings


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, scheduler=False)) as client:
        yield client


def scrape(client: TestClient, headers: dict[str, str] | None = AUTH) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}}."""
    resp = client.get("/metrics", headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def submit(client: TestClient, gpus: int, **extra: object) -> int:
    spec = {"mode": "dp", "gpus_per_node": gpus, "entrypoint": BUILTIN, **extra}
    resp = client.post("/v1/jobs", json=spec, headers=AUTH)
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def start_node(client: TestClient, job_id: int, attempt: int) -> None:
    """What a worker does when its node's torchrun starts."""
    with client.app.state.db.transaction() as session:
        assert lifecycle.claim_node(session, job_id, attempt, 0, "w1-session") is not None


def test_metrics_need_a_token(client: TestClient) -> None:
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/metrics", headers=AUTH).status_code == 200


def test_jobs_queue_waits_gpus_and_request_latency(client: TestClient, settings: Settings) -> None:
    db = client.app.state.db
    with db.transaction() as session:
        host_states.upsert_worker(
            session,
            name="w1",
            address="10.0.0.1",
            accelerator="cpu",
            gpus=2,
            session_id="w1-session",
            now=utcnow(),
        )
    retried = submit(client, 1, max_retries=1)
    waiting = submit(client, 2)
    cancelled = submit(client, 1)
    assert client.post(f"/v1/jobs/{cancelled}/cancel", headers=AUTH).status_code == 202

    # The retried job: placed, started, lost to an infrastructure failure, requeued, started again.
    run_pass(db, settings, lambda _items: None)
    start_node(client, retried, 1)
    with db.transaction() as session:
        job = lifecycle.lock_job(session, retried)
        lifecycle.end_attempt(session, job, None, "worker lost", retryable=True)
    run_pass(db, settings, lambda _items: None)
    start_node(client, retried, 2)

    for job_id in (retried, waiting):
        assert client.get(f"/v1/jobs/{job_id}", headers=AUTH).status_code == 200
    assert client.get("/v1/jobs/999999", headers=AUTH).status_code == 404
    assert client.get("/no/such/path").status_code == 404

    with db.read() as session:
        waits = metrics_repo.queue_waits(session)
    assert len(waits) == 2 and all(started >= queued for queued, started in waits)

    m = scrape(client)
    states = {dict(k)["state"]: v for k, v in m["torchjobs_jobs"].items()}
    assert set(states) == set(ALL_STATES)
    assert states == {**dict.fromkeys(ALL_STATES, 0.0), "running": 1.0, "queued": 1.0, "cancelled": 1.0}

    # Two attempts started (the retry waited again); the 2-GPU job still waits; no wait is negative.
    assert m["torchjobs_job_queue_wait_seconds_count"][()] == 2
    assert 0 <= m["torchjobs_job_queue_wait_seconds_sum"][()] < 60
    buckets = {dict(k)["le"]: v for k, v in m["torchjobs_job_queue_wait_seconds_bucket"].items()}
    assert len(buckets) == len(QUEUE_WAIT_BUCKETS) + 1 and buckets["+Inf"] == 2
    assert m["torchjobs_queue_oldest_wait_seconds"][()] > 0

    worker = (("worker", "w1"),)
    assert m["torchjobs_worker_gpus"][worker] == 2
    assert m["torchjobs_worker_gpus_used"][worker] == 1
    assert m["torchjobs_worker_gpus_free"][worker] == 1
    assert m["torchjobs_worker_online"][worker] == 1

    latency = m["torchjobs_http_request_duration_seconds_count"]
    routes = {dict(k)["route"] for k in latency}
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "<unmatched>"} <= routes
    assert not any("999999" in r or r.startswith("/v1/jobs/1") for r in routes), routes
    got = latency[(("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "200"))]
    assert got == 2
    assert latency[(("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "404"))] == 1
    assert latency[(("method", "POST"), ("route", "/v1/jobs"), ("status", "201"))] == 3


def test_each_app_has_its_own_registry_and_can_be_public(
    client: TestClient, pg_url: str, settings: Settings
) -> None:
    client.get("/healthz")
    assert "torchjobs_http_request_duration_seconds" not in {m.name for m in REGISTRY.collect()}

    public = settings_for(pg_url, settings.home, metrics_public=True)
    with TestClient(create_app(public, scheduler=False)) as other:
        m = scrape(other, headers=None)
    # Only the scrape itself so far: the first app's /healthz is not in the second app's registry.
    routes = {dict(k)["route"] for k in m.get("torchjobs_http_request_duration_seconds_count", {})}
    assert "/healthz" not in routes
    assert m["torchjobs_jobs"][(("state", "queued"),)] == 0


def test_queue_wait_histogram_is_cumulative() -> None:
    family = queue_wait_histogram([0.5, 1.0, 7.0, -3.0, 10**6])
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("torchjobs_job_queue_wait_seconds_bucket", "1.0")] == 3  # 0.5, 1.0 and the skewed -3
    assert samples[("torchjobs_job_queue_wait_seconds_bucket", "5.0")] == 3
    assert samples[("torchjobs_job_queue_wait_seconds_bucket", "15.0")] == 4
    assert samples[("torchjobs_job_queue_wait_seconds_bucket", "+Inf")] == 5
    assert samples[("torchjobs_job_queue_wait_seconds_count", None)] == 5
    assert samples[("torchjobs_job_queue_wait_seconds_sum", None)] == 0.5 + 1.0 + 7.0 + 10**6


def test_the_scheduler_thread_times_its_passes(settings: Settings) -> None:
    """`torchjobs_scheduler_pass_seconds`: what bench/scale.py reads of the server's scheduler."""
    with TestClient(create_app(settings, scheduler=True)) as client:
        submit(client, 1)  # wakes the scheduler
        counted = lambda: scrape(client).get("torchjobs_scheduler_pass_seconds_count", {}).get((), 0)  # noqa: E731
        deadline = time.monotonic() + 30
        while counted() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        samples = scrape(client)
        assert samples["torchjobs_scheduler_pass_seconds_count"][()] >= 2
        assert samples["torchjobs_scheduler_pass_seconds_sum"][()] > 0


def user_headers(client: TestClient, name: str) -> dict[str, str]:
    created = client.post("/v1/users", json={"name": name}, headers=AUTH)
    assert created.status_code == 201, created.text
    return {"Authorization": f"Bearer {created.json()['token']}"}


def run_one_job_each(client: TestClient, settings: Settings, *owners: dict[str, str]) -> None:
    """Each owner's 1-GPU job placed on a worker and started: GPU-seconds to show per user."""
    db = client.app.state.db
    with db.transaction() as session:
        host_states.upsert_worker(
            session,
            name="w1",
            address="10.0.0.1",
            accelerator="cpu",
            gpus=len(owners),
            session_id="w1-session",
            now=utcnow(),
        )
    spec = {"mode": "dp", "gpus_per_node": 1, "entrypoint": BUILTIN}
    jobs = []
    for headers in owners:
        resp = client.post("/v1/jobs", json=spec, headers=headers)
        assert resp.status_code == 201, resp.text
        jobs.append(resp.json()["id"])
    run_pass(db, settings, lambda _items: None)
    for job_id in jobs:
        start_node(client, job_id, 1)


def user_labels(text: str) -> set[str]:
    return {
        s.labels["user"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "user" in s.labels
    }


def test_per_user_figures_are_the_admins_only(client: TestClient, settings: Settings) -> None:
    """Contract §7: a user's scrape has every series but the per-user ones; the admin's has them."""
    alice, bob = user_headers(client, "alice"), user_headers(client, "bob")
    run_one_job_each(client, settings, alice, bob)

    as_admin = client.get("/metrics", headers=AUTH)
    assert as_admin.status_code == 200, as_admin.text
    assert user_labels(as_admin.text) == {"alice", "bob"}
    assert "torchjobs_user_gpu_seconds_total{" in as_admin.text

    as_alice = client.get("/metrics", headers=alice)
    assert as_alice.status_code == 200, as_alice.text
    assert user_labels(as_alice.text) == set()
    assert "torchjobs_user_gpu_seconds" not in as_alice.text
    assert "bob" not in as_alice.text and "alice" not in as_alice.text
    assert 'user="' not in as_alice.text
    # Everything that is not per user is still there.
    m = scrape(client, headers=alice)
    assert m["torchjobs_jobs"][(("state", "running"),)] == 2
    assert m["torchjobs_worker_gpus_used"][(("worker", "w1"),)] == 2
    assert m["torchjobs_job_queue_wait_seconds_count"][()] == 2
    assert m["torchjobs_http_request_duration_seconds_count"]

    # The OpenMetrics exposition is filtered the same way.
    openmetrics = {"Accept": "application/openmetrics-text; version=1.0.0", **alice}
    resp = client.get("/metrics", headers=openmetrics)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/openmetrics-text")
    assert "bob" not in resp.text and "torchjobs_user_gpu_seconds" not in resp.text
    resp = client.get("/metrics", headers={**openmetrics, **AUTH})
    assert 'user="bob"' in resp.text


def test_public_metrics_show_per_user_figures_to_the_admin_only(pg_url: str, settings: Settings) -> None:
    """Without a token (TORCHJOBS_METRICS_PUBLIC) a scrape is still answered, less the per-user
    series; the admin's token there still shows them."""
    public = settings_for(pg_url, settings.home, metrics_public=True)
    with TestClient(create_app(public, scheduler=False)) as client:
        alice = user_headers(client, "alice")
        run_one_job_each(client, public, alice)
        for headers in (None, alice, {"Authorization": "Bearer nope"}):
            resp = client.get("/metrics", headers=headers)
            assert resp.status_code == 200, (headers, resp.text)
            assert user_labels(resp.text) == set() and "alice" not in resp.text, headers
            assert 'torchjobs_jobs{state="running"} 1.0' in resp.text
        assert user_labels(client.get("/metrics", headers=AUTH).text) == {"alice"}
