"""Issue 7: cancels, lost workers, retries from the last checkpoint, restarts — real processes killed.

Each test builds its own PostgreSQL + Redis stack, because these tests kill its parts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.testing import harness
from service.testing.harness import Stack, pids_of_job, wait_event, wait_for
from tests.integration.weights import final_weights

LONG = {"kind": "builtin", "model": "cnn", "dataset": "synthetic"}
# A single-process job of some seconds: long enough to disturb something while it runs.
SHORT_SINGLE = {
    "mode": "single",
    "entrypoint": LONG,
    "hyperparameters": {"epochs": 3, "synthetic_size": 8000, "num_workers": 0},
}


@pytest.fixture
def stack(tmp_path: Path, pg_url: str, redis_url: str) -> Iterator[Stack]:
    s = harness.production_stack(tmp_path, pg_url, redis_url, workers={"w1": 2}, warm=False)
    yield s
    s.stop()


def long_job(**extra: object) -> dict:
    spec = {
        "mode": "ddp",
        "gpus_per_node": 2,
        "entrypoint": LONG,
        "hyperparameters": {"epochs": 200, "synthetic_size": 4096, "num_workers": 0, "report_every": 5},
    }
    spec.update(extra)
    return spec


def gpus_free(stack: Stack, worker: str) -> int:
    with stack.client() as c:
        return next(w["gpus_free"] for w in c.get("/v1/workers").json()["items"] if w["name"] == worker)


def test_cancel_running_ddp_job_leaves_no_process_and_frees_gpus(stack: Stack) -> None:
    job = stack.submit(long_job())
    wait_event(stack, job["id"], lambda e: e["type"] == "progress")
    assert pids_of_job(job["id"], stack.home)  # it really runs
    assert gpus_free(stack, "w1") == 0
    started = time.monotonic()
    with stack.client() as c:
        resp = c.post(f"/v1/jobs/{job['id']}/cancel")
        assert resp.status_code == 202 and resp.json()["state"] == "cancelling"
        assert c.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202  # twice is harmless
    done = stack.wait_job(job["id"], timeout=60)
    assert done["state"] == "cancelled"
    assert time.monotonic() - started < 5 + 10  # grace (5 s here) plus a few seconds
    assert pids_of_job(job["id"], stack.home) == []
    assert gpus_free(stack, "w1") == 2
    with stack.client() as c:
        assert c.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202  # already cancelled: fine


def test_cancel_queued_job_is_immediate_and_finished_job_is_409(stack: Stack) -> None:
    blocker = stack.submit(long_job())
    queued = stack.submit(long_job())
    with stack.client() as c:
        assert c.get(f"/v1/jobs/{queued['id']}").json()["state"] == "queued"
        resp = c.post(f"/v1/jobs/{queued['id']}/cancel")
        assert resp.status_code == 202 and resp.json()["state"] == "cancelled"
        c.post(f"/v1/jobs/{blocker['id']}/cancel")
    states = [e["data"]["state"] for e in stack.events(queued["id"]) if e["type"] == "state"]
    assert states == ["queued", "cancelling", "cancelled"]  # the contract's path, even when immediate
    stack.wait_job(blocker["id"], timeout=60)
    fail = stack.submit({"mode": "single", "entrypoint": {"kind": "script", "path": "fail.py"}})
    stack.wait_job(fail["id"])
    with stack.client() as c:
        assert c.post(f"/v1/jobs/{fail['id']}/cancel").status_code == 409


def is_agent(pid: int) -> bool:
    """A torchrun agent, started cold or handed the launch while warm (workers/launcher/warm_agent.py):
    the program run, not one named further on (a sandbox's PID 1, sandbox.ENTRY, names its child's)."""
    argv = cmdline(pid).split(b"\0")
    return argv[1:3] in ([b"-m", b"torch.distributed.run"], [b"-m", b"workers.launcher.warm_agent"])


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize(("sandbox", "timed"), [("auto", False), ("off", False), ("auto", True)])
def test_killed_worker_job_retries_from_checkpoint_to_identical_weights(
    tmp_path: Path, pg_url: str, redis_url: str, sandbox: str, timed: bool
) -> None:
    """`timed`: checkpoints by time only (`checkpoint_every_s`, contract §8), so the worker
    dies mid-epoch and the retry starts from the middle of that epoch."""
    workers = {"w1": 2}
    stack = harness.production_stack(
        tmp_path, pg_url, redis_url, workers, warm=False, TORCHJOBS_SANDBOX=sandbox
    )
    try:
        _killed_worker_retries(stack, sandboxed=sandbox == "auto", timed=timed)
    finally:
        stack.stop()


def _killed_worker_retries(stack: Stack, sandboxed: bool, timed: bool = False) -> None:
    hyper = {"epochs": 3, "synthetic_size": 12000, "num_workers": 0, "report_every": 20, "seed": 3}
    if timed:
        # one epoch of about 15 s (a 2-s checkpoint lands early in it, then the kill): 120,000
        # samples took 50 s a run, twice, for nothing the shorter epoch does not show
        hyper.update(epochs=1, synthetic_size=40000, checkpoint_every=1000, checkpoint_every_s=2)
    spec = {"mode": "single", "entrypoint": LONG, "hyperparameters": hyper, "max_retries": 1}
    job = stack.submit(spec)
    first = wait_event(stack, job["id"], lambda e: e["type"] == "checkpoint")
    if timed:
        assert first["data"]["epoch"] == 0 and first["data"]["step"] > 0, first  # mid-epoch
    # The worst case: the worker and its torchrun agent die at once (SIGKILL), so nobody
    # tells the ranks, which torchrun runs in sessions of their own.
    agents = [p for p in pids_of_job(job["id"], stack.home) if is_agent(p)]
    assert agents
    stack.kill("worker-w1")
    for pid in agents:
        os.kill(pid, signal.SIGKILL)
    if sandboxed:  # the agent is PID 1's child: PID 1 ends with it, and the kernel ends every rank
        wait_for(lambda: pids_of_job(job["id"], stack.home) == [] or None, 20, "the sandbox to be gone")
    else:
        assert pids_of_job(job["id"], stack.home)  # orphans: the ranks are still running
    stack.start_worker("w1", 2)  # the new worker process stops what is left first
    wait_for(
        lambda: all(b"attempt-1" not in environ(p) for p in pids_of_job(job["id"], stack.home)) or None,
        20,
        "the orphans of attempt 1 to be gone",
    )
    done = stack.wait_job(job["id"], timeout=300)
    assert done["state"] == "succeeded", done["error"]
    assert done["attempt"] == 2
    assert [a["attempt"] for a in done["attempts"]] == [1, 2]
    assert "worker lost" in (done["attempts"][0]["reason"] or "")
    states = [e["data"]["state"] for e in stack.events(job["id"]) if e["type"] == "state"]
    assert states == ["queued", "scheduled", "running", "queued", "scheduled", "running", "succeeded"]

    straight = stack.submit({**spec, "max_retries": 0})
    straight_done = stack.wait_job(straight["id"], timeout=300)
    assert straight_done["state"] == "succeeded"
    a, b = final_weights(stack, done), final_weights(stack, straight_done)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_killing_one_node_of_a_two_node_job_ends_the_attempt(stack: Stack) -> None:
    stack.start_worker("w2", 2)
    job = stack.submit(long_job(nodes=2))
    wait_event(stack, job["id"], lambda e: e["type"] == "progress", timeout=180)
    assignments = stack.wait_job(job["id"], states=("running",))["assignments"]
    assert {a["worker"] for a in assignments} == {"w1", "w2"}
    victim = next(a["worker"] for a in assignments if a["node_rank"] == 1)
    stack.kill(f"worker-{victim}")
    done = stack.wait_job(job["id"], timeout=60)
    assert done["state"] == "failed"
    wait_for(
        lambda: pids_of_job(job["id"], stack.home) == [] or None, 30, "the surviving node's ranks to be gone"
    )


def test_api_server_restart_mid_job(stack: Stack) -> None:
    spec = SHORT_SINGLE
    job = stack.submit(spec)
    wait_event(stack, job["id"], lambda e: e["type"] == "progress")
    stack.kill("server")
    time.sleep(2)
    stack.start_server()
    done = stack.wait_job(job["id"], timeout=240)
    assert done["state"] == "succeeded", done["error"]
    seqs = [e["seq"] for e in stack.events(job["id"])]
    assert seqs == list(range(1, len(seqs) + 1))


def test_same_message_twice_does_not_start_a_second_copy(stack: Stack) -> None:
    from service.config import Settings
    from service.nodes.wire import send_node
    from workers.celery_app import make_celery

    job = stack.submit(long_job(mode="single", gpus_per_node=1))
    wait_event(stack, job["id"], lambda e: e["type"] == "progress")
    celery = make_celery(Settings(broker_url=stack.env["TORCHJOBS_BROKER_URL"]))
    for _ in range(2):  # the broker delivering the same node again, twice
        send_node(celery, job_id=job["id"], attempt=1, node_rank=0, worker="w1")
    wait_for(
        lambda: stack.logs_of("worker-w1").count("nothing to do") >= 2 or None, 30, "both repeats handled"
    )
    agents = [p for p in pids_of_job(job["id"], stack.home) if is_agent(p)]
    assert len(agents) == 1
    with stack.client() as c:
        running = c.get(f"/v1/jobs/{job['id']}").json()
        assert running["state"] == "running" and running["attempt"] == 1
        c.post(f"/v1/jobs/{job['id']}/cancel")
    assert stack.wait_job(job["id"], timeout=60)["state"] == "cancelled"


class OwnRedis:
    """A real Redis server of this test's own, on a port of its own: stopping it cuts no other
    test's broker (the suite runs in two processes; the shared server on 6379 stays up)."""

    def __init__(self, workdir: Path) -> None:
        self.port = harness.free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _ping(self) -> bool:
        ping = subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True)
        return ping.returncode == 0

    def start(self) -> None:
        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.workdir)]
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen([*argv, "--save", "", "--appendonly", "no"], stdout=log, stderr=log)
        wait_for(lambda: self._ping() or None, 15, "redis to start")

    def stop(self) -> None:
        """Its queued messages go with it (no save): what a crashed broker loses."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=15)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        time.sleep(2)
        self.start()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = OwnRedis(workdir)
    server.start()
    yield server
    server.stop()


def test_redis_restart_mid_job(tmp_path: Path, pg_url: str, own_redis: OwnRedis) -> None:
    (tmp_path / "stack").mkdir()
    stack = harness.production_stack(tmp_path / "stack", pg_url, own_redis.url, workers={"w1": 2}, warm=False)
    try:
        _jobs_outlive_a_broker_restart(stack, own_redis)
    finally:
        stack.stop()


def _jobs_outlive_a_broker_restart(stack: Stack, broker: OwnRedis) -> None:
    spec = SHORT_SINGLE
    job = stack.submit(spec)
    wait_event(stack, job["id"], lambda e: e["type"] == "progress")
    broker.restart()  # the queued message of the next job was lost with it: it is sent again
    second = stack.submit(spec)
    for j in (job, second):
        done = stack.wait_job(j["id"], timeout=300)
        assert done["state"] == "succeeded", done["error"]
        seqs = [e["seq"] for e in stack.events(j["id"])]
        assert seqs == list(range(1, len(seqs) + 1))


def refuse_connections(pg_url: str, refuse: bool) -> None:
    """PostgreSQL turning every connection of this database away, the open ones cut, as
    through a restart or a fail-over: on a real server, not a mock."""
    import psycopg

    name = pg_url.rsplit("/", 1)[1]
    with psycopg.connect(harness.PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {"false" if refuse else "true"}')
        if refuse:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))


def test_a_database_outage_mid_job_does_not_stop_the_training(stack: Stack, pg_url: str) -> None:
    """The ranks keep training through it; what they wrote meanwhile is stored once the
    database is back: every epoch's checkpoint, every progress report, the log, attempt 1.
    And the scheduler, back, does not take the worker for lost: its heartbeats could not land."""
    epochs = 16  # some seconds of training on each side of the outage (about 1 s an epoch here)
    spec = {**SHORT_SINGLE, "hyperparameters": {**SHORT_SINGLE["hyperparameters"], "epochs": epochs}}
    job = stack.submit(spec)
    wait_event(stack, job["id"], lambda e: e["type"] == "progress")
    refuse_connections(pg_url, True)
    try:
        started = time.monotonic()
        with stack.client() as c:  # meanwhile the API says so, and a submit changes nothing
            for resp in (c.get("/v1/jobs"), c.post("/v1/jobs", json=spec)):
                assert resp.status_code == 503, resp.text
                assert resp.headers["retry-after"] and "database" in resp.json()["detail"]
        # Longer than the tests' heartbeat timeout (6 s): no worker may look lost for it.
        time.sleep(max(0.0, 8 - (time.monotonic() - started)))
    finally:
        refuse_connections(pg_url, False)
    done = stack.wait_job(job["id"], timeout=300)
    assert done["state"] == "succeeded", done["error"]
    assert done["attempt"] == 1
    events = stack.events(job["id"])
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    with stack.client() as c:
        ckpts = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
    assert sorted(ck["epoch"] for ck in ckpts) == list(range(1, epochs + 1))
    reports = [e["data"] for e in events if e["type"] == "progress"]
    assert any(r.get("epoch") == epochs for r in reports)
    with stack.client() as c:
        assert [j["id"] for j in c.get("/v1/jobs").json()["items"]] == [job["id"]]
