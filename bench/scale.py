"""The control plane at scale: N simulated worker hosts and K running nodes against one API
server and its scheduler on PostgreSQL + Redis, while clients poll, list, submit and stream.

    .venv/bin/python -m bench.scale                      # 10/5, 100/50, 300/150, 1000/500; ~5 min
    .venv/bin/python -m bench.scale --doc docs/scaling.md
    .venv/bin/python -m bench.scale --smoke              # 10 hosts, 20 jobs, a few seconds

The hosts are simulated in this process with the product's own worker-side functions and no
torch: `upsert_worker` to register, `heartbeat` every `heartbeat_interval_s` (5 s), claims
with `claim_for_launch` of the nodes the scheduler placed on them, an output batch per running
node every 0.2 s (`reports.write_batch`: a log line and a progress event, as the supervisor
stores them for a node whose ranks report all the time: `EVENT_GAP_S`) and the node's end
(`record_end`) after 10 to 30 s, when the queue's next job
takes its slot. Each host has one GPU slot. The clients are real HTTP clients of the server:
4 pollers of `GET /v1/jobs/{id}`, a lister of `GET /v1/jobs`, a submitter of `POST
/v1/jobs`, and SSE streams on running jobs that time each progress event from its write.

Reported per step: the server's scheduler pass (its own histogram), GET/POST/list p50 and
p99, event lag p99, commits/s and PostgreSQL's CPU (cores), the load offered and achieved
(heartbeats/s, batches/s), and the first thing that broke: a host taken offline while it
kept beating (a false heartbeat timeout), a node lost, or load the machine could not offer.
Everything shares this machine's cores: the simulator's own CPU is part of the picture.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import REPO, figure, machine, production_stack, utc_now, workdir, write_result
from service.testing import harness
from workers.launcher.supervisor import EVENT_GAP_S

# The supervisor's cadence for a node that reports all the time (workers/launcher/supervisor.py)
BATCH_EVERY_S = EVENT_GAP_S
STREAMS = 10


@dataclass
class Step:
    hosts: int
    running: int  # nodes to keep running (one slot per host)
    seconds: float
    jobs: int = 0  # queued at the start (0: running and half as many again)


@dataclass
class Load:
    """What the simulated hosts offered and what the database took."""

    beats: int = 0
    max_beat_gap_s: float = 0.0
    batches: int = 0
    claims: int = 0
    ends: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class Clients:
    get: list[float] = field(default_factory=list)
    post: list[float] = field(default_factory=list)
    list_: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    failures: int = 0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ------------------------------------------------------------------------------------------ the hosts


def beat_hosts(
    settings: Any, hosts: dict[str, str], threads: int, stop: Any, beats: Any, max_gap: Any, errors: Any
) -> None:
    """Every host's heartbeat every `heartbeat_interval_s`, spread evenly, in a process of its
    own: on one host a beat is its agent's thread; here a thousand share one GIL, which the
    claims and batches must not wait behind."""
    from service.db import Database
    from service.hosts.states import heartbeat
    from service.models import utcnow

    db = Database(settings)
    names = list(hosts)
    interval_s = settings.heartbeat_interval_s

    def share(mine: list[str]) -> None:
        last: dict[str, float] = {}
        gap = interval_s / max(1, len(mine))
        due, i = time.monotonic(), 0
        while not stop.is_set():
            name = mine[i % len(mine)]
            try:
                with db.transaction() as s:
                    heartbeat(s, name, hosts[name], utcnow())
            except Exception:  # keep beating; count it
                with errors.get_lock():
                    errors.value += 1
            now = time.monotonic()
            with max_gap.get_lock():
                max_gap.value = max(max_gap.value, now - last.get(name, now))
            with beats.get_lock():
                beats.value += 1
            last[name] = now
            i += 1
            due += gap
            time.sleep(max(0.0, due - time.monotonic()))

    workers = [threading.Thread(target=share, args=(names[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    db.dispose()


class SimHosts:
    def __init__(self, db: Any, count: int, load: Load, stop: threading.Event) -> None:
        self.db, self.load, self.stop = db, load, stop
        self.hosts = {f"sim-{i:04d}": uuid.uuid4().hex for i in range(count)}
        self.running: dict[Any, tuple[str, float, int]] = {}  # key -> (host, ends at, log offset)
        self.lock = threading.Lock()

    def register(self) -> None:
        from service.hosts.states import upsert_worker
        from service.models import utcnow

        with self.db.transaction() as s:
            for i, (name, session_id) in enumerate(self.hosts.items()):
                upsert_worker(
                    s,
                    name=name,
                    address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                    accelerator="cpu",
                    gpus=1,
                    session_id=session_id,
                    now=utcnow(),
                    isolation="sandbox",
                    open_to_all=True,
                )

    def claim(self, shard: int = 0, shards: int = 1) -> None:
        """What Celery's message does on a real host: the placed node is claimed and runs.
        Several claimers (a host's own claim runs on that host, in parallel with the others')."""
        from sqlalchemy import select

        from service.jobs.lifecycle import claim_for_launch
        from service.models import NodeRun
        from service.nodes.values import NodeKey
        from service.states import NodeState

        while not self.stop.wait(0.25):
            with self.db.read() as s:
                rows = s.execute(
                    select(NodeRun.job_id, NodeRun.attempt, NodeRun.node_rank, NodeRun.worker_name).where(
                        NodeRun.state == NodeState.PENDING, NodeRun.worker_name.like("sim-%")
                    )
                ).all()
            for job_id, attempt, node_rank, host in rows:
                if int(host[4:]) % shards != shard:
                    continue
                key = NodeKey(job_id=job_id, attempt=attempt, node_rank=node_rank)
                with self.db.transaction() as s:
                    claimed = claim_for_launch(s, key, self.hosts[host])
                if claimed is not None:
                    with self.lock:
                        self.running[key] = (host, time.monotonic() + random.uniform(10, 30), 0)
                    self.load.claims += 1

    def report(self, shard: int, shards: int) -> None:
        """An output batch per running node every BATCH_EVERY_S; a node's end when its time is up."""
        from service.db import KeptConnection
        from service.jobs.lifecycle import record_end
        from service.jobs.reports import write_batch
        from service.nodes.values import Batch, NodeOutcome
        from service.states import NodeState

        conn = KeptConnection(self.db)
        step = 0
        while not self.stop.wait(BATCH_EVERY_S):
            step += 1
            with self.lock:
                mine = [(k, v) for k, v in self.running.items() if k.job_id % shards == shard]
            for key, (host, ends_at, offset) in mine:
                if time.monotonic() >= ends_at:
                    record_end(self.db, key, NodeOutcome(state=NodeState.SUCCEEDED, exit_code=0), worker=host)
                    with self.lock:
                        self.running.pop(key, None)
                    self.load.ends += 1
                    continue
                line = f"step {step} loss {1 / step:.4f}\n".encode()
                event = {"type": "progress", "t_write": time.time(), "step": step, "loss": 1 / step}
                try:
                    write_batch(conn, key, Batch(logs=[(0, offset, line)], events=[event]))
                except Exception as exc:
                    self.load.errors.append(f"batch: {exc.__class__.__name__}")
                    continue
                with self.lock:
                    if key in self.running:
                        self.running[key] = (host, ends_at, offset + len(line))
                self.load.batches += 1
        conn.close()

    def running_jobs(self) -> list[int]:
        with self.lock:
            return [k.job_id for k in self.running]


# ------------------------------------------------------------------------------------------ the clients


def clients(url: str, sim: SimHosts, out: Clients, stop: threading.Event) -> list[threading.Thread]:
    load = ClientLoad(url=url, sim=sim, out=out, stop=stop)
    targets = [load.poller] * 4 + [load.lister, load.submitter] + [load.stream] * STREAMS
    return [threading.Thread(target=t, daemon=True) for t in targets]


@dataclass(frozen=True, kw_only=True)
class ClientLoad:
    """What the clients do until `stop`, each in its thread; their timings go to `out`."""

    url: str
    sim: SimHosts
    out: Clients
    stop: threading.Event
    auth: dict[str, str] = field(default_factory=lambda: {"Authorization": f"Bearer {harness.ADMIN_TOKEN}"})
    spec: dict[str, Any] = field(
        default_factory=lambda: {
            "mode": "single",
            "entrypoint": {"kind": "builtin", "model": "mlp"},
            "hyperparameters": {"epochs": 1},
        }
    )

    def timed(self, c: httpx.Client, sink: list[float], method: str, path: str, **kw: Any) -> None:
        t0 = time.perf_counter()
        try:
            ok = c.request(method, path, **kw).status_code < 400
        except httpx.HTTPError:
            ok = False
        sink.append(time.perf_counter() - t0)
        self.out.failures += 0 if ok else 1

    def poller(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.auth, timeout=30) as c:
            while not self.stop.wait(0.05):
                jobs = self.sim.running_jobs()
                if jobs:
                    self.timed(c, self.out.get, "GET", f"/v1/jobs/{random.choice(jobs)}")

    def lister(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.auth, timeout=30) as c:
            while not self.stop.wait(0.5):
                self.timed(c, self.out.list_, "GET", "/v1/jobs", params={"limit": 50})

    def submitter(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.auth, timeout=30) as c:
            while not self.stop.wait(0.5):
                self.timed(c, self.out.post, "POST", "/v1/jobs", json=self.spec)

    def stream(self) -> None:
        while not self.stop.is_set():
            jobs = self.sim.running_jobs()
            if not jobs:
                time.sleep(0.2)
                continue
            try:
                self._follow(random.choice(jobs))
            except (httpx.HTTPError, ValueError):
                continue

    def _follow(self, job_id: int) -> None:
        """One job's event stream until it ends or `stop`: the lag of each event written since."""
        connected = time.time()  # the replayed history is not lag: only what was written since
        with (
            httpx.Client(base_url=self.url, headers=self.auth, timeout=httpx.Timeout(30, read=5)) as c,
            c.stream("GET", f"/v1/jobs/{job_id}/events/stream") as resp,
        ):
            for line in resp.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("data:"):
                    data = json.loads(line[5:]).get("data", {})
                    if data.get("t_write", 0) > connected:
                        self.out.lag.append(time.time() - data["t_write"])


# ------------------------------------------------------------------------------------------ a step


def cpu_s(pid: Path) -> float:
    """utime + stime of one process (and its reaped children), in seconds."""
    import os

    fields = (pid / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_cpu_s() -> float:
    total = 0.0
    for pid in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            if (pid / "comm").read_text().strip() == "postgres":
                total += cpu_s(pid)
        except (OSError, IndexError, ValueError):
            continue
    return total


def commits(pg_url: str) -> int:
    import psycopg

    name = pg_url.rsplit("/", 1)[1]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (name,)).fetchone()
    return int(row[0]) if row else 0


def pass_histogram(url: str) -> tuple[float, float, dict[float, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=harness.auth(), timeout=30).text
    count = total = 0.0
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "torchjobs_scheduler_pass_seconds_count":
                count = s.value
            elif s.name == "torchjobs_scheduler_pass_seconds_sum":
                total = s.value
            elif s.name == "torchjobs_scheduler_pass_seconds_bucket":
                buckets[float(s.labels["le"])] = s.value
    return count, total, buckets


def pass_p99(before: dict[float, float], after: dict[float, float]) -> float | None:
    delta = sorted((le, after.get(le, 0) - before.get(le, 0)) for le in after)
    if not delta or delta[-1][1] <= 0:
        return None
    for le, n in delta:
        if n >= 0.99 * delta[-1][1]:
            return le
    return None


def seed_jobs(db: Any, count: int) -> None:
    """The queue, through the product's own submit (the admin's jobs, 1 GPU each)."""
    from sqlalchemy import select

    from service.jobs.service import submit_job
    from service.jobs.spec import JobSpec
    from service.models import User

    spec = JobSpec.model_validate({"mode": "single", "entrypoint": {"kind": "builtin", "model": "mlp"}})
    with db.transaction() as s:
        admin = s.execute(select(User).where(User.is_admin)).scalars().first()
        for _ in range(count):
            submit_job(s, db.settings, None, admin, spec, None)  # type: ignore[arg-type]


def run_step(step: Step, scratch: Path) -> dict[str, Any]:
    from sqlalchemy import func, select

    from service.config import Settings
    from service.db import Database
    from service.models import NodeRun, Worker
    from service.states import NodeState, WorkerState

    with production_stack(scratch, {}) as (stack, pg_url):
        settings = Settings(home=scratch, database_url=pg_url, broker_url=stack.env["TORCHJOBS_BROKER_URL"])
        db = Database(settings)
        stop, load, out = threading.Event(), Load(), Clients()
        sim = SimHosts(db, step.hosts, load, stop)
        sim.register()
        seed_jobs(db, step.jobs or step.running + step.running // 2)
        spawn = multiprocessing.get_context("spawn")
        beat_stop, beats_v = spawn.Event(), spawn.Value("q", 0)
        gap_v, errors_v = spawn.Value("d", 0.0), spawn.Value("q", 0)
        beater = spawn.Process(
            target=beat_hosts,
            args=(
                settings,
                sim.hosts,
                max(1, min(4, step.hosts // 100)),
                beat_stop,
                beats_v,
                gap_v,
                errors_v,
            ),
            daemon=True,
        )
        beater.start()
        claimers = max(1, min(6, step.hosts // 100))
        threads = [
            threading.Thread(target=sim.claim, args=(i, claimers), daemon=True) for i in range(claimers)
        ]
        reporters = max(1, min(8, step.running // 25))
        threads += [
            threading.Thread(target=sim.report, args=(i, reporters), daemon=True) for i in range(reporters)
        ]
        for t in threads:
            t.start()
        target = min(step.running, step.hosts) * 0.9
        started = time.monotonic()
        while len(sim.running) < target and time.monotonic() - started < 120:
            time.sleep(0.5)
        ramp_s = time.monotonic() - started  # placing and claiming K nodes (may not get there)
        client_threads = clients(stack.url, sim, out, stop)
        for t in client_threads:
            t.start()
        load.batches = 0
        with beats_v.get_lock():
            beats_v.value = 0
        server = Path(f"/proc/{stack.procs['server'].pid}")
        api0 = cpu_s(server)
        c0, (n0, s0, b0), cpu0, t0 = (
            commits(pg_url),
            pass_histogram(stack.url),
            postgres_cpu_s(),
            time.monotonic(),
        )
        running_samples = []
        while time.monotonic() - t0 < step.seconds:
            running_samples.append(len(sim.running))
            time.sleep(min(1.0, step.seconds / 4))
        elapsed = time.monotonic() - t0
        c1, (n1, s1, b1), cpu1 = commits(pg_url), pass_histogram(stack.url), postgres_cpu_s()
        api1 = cpu_s(server)
        beats, batches = beats_v.value, load.batches
        stop.set()
        beat_stop.set()
        beater.join(timeout=30)
        load.max_beat_gap_s = gap_v.value
        if errors_v.value:
            load.errors.append(f"heartbeat: {errors_v.value} failed")
        for t in threads + client_threads:
            t.join(timeout=30)
        with db.read() as s:
            offline = s.execute(
                select(func.count()).select_from(Worker).where(Worker.state == WorkerState.OFFLINE)
            ).scalar_one()
            lost = s.execute(
                select(func.count()).select_from(NodeRun).where(NodeRun.state == NodeState.LOST)
            ).scalar_one()
        db.dispose()
    offered_beats = step.hosts / settings.heartbeat_interval_s
    running_avg = sum(running_samples) / len(running_samples)
    offered_batches = running_avg / BATCH_EVERY_S
    result: dict[str, Any] = {
        "hosts": step.hosts,
        "running": step.running,
        "running_avg": round(running_avg, 1),
        "seconds": round(elapsed, 1),
        "ramp_s": round(ramp_s, 1),
        "ramp_reached": len(running_samples) > 0 and running_samples[0] >= target,
        "pass_mean_s": (s1 - s0) / (n1 - n0) if n1 > n0 else None,
        "pass_p99_s": pass_p99(b0, b1),
        "passes": int(n1 - n0),
        "get_p50_s": pct(out.get, 0.5),
        "get_p99_s": pct(out.get, 0.99),
        "post_p50_s": pct(out.post, 0.5),
        "post_p99_s": pct(out.post, 0.99),
        "list_p50_s": pct(out.list_, 0.5),
        "list_p99_s": pct(out.list_, 0.99),
        "lag_p50_s": pct(out.lag, 0.5),
        "lag_p99_s": pct(out.lag, 0.99),
        "lag_samples": len(out.lag),
        "client_failures": out.failures,
        "commits_per_s": (c1 - c0) / elapsed,
        "postgres_cores": (cpu1 - cpu0) / elapsed,
        "server_cores": (api1 - api0) / elapsed,
        "beats_per_s": beats / elapsed,
        "beats_offered_per_s": offered_beats,
        "max_beat_gap_s": load.max_beat_gap_s,
        "batches_per_s": batches / elapsed,
        "batches_offered_per_s": offered_batches,
        "claims": load.claims,
        "ends": load.ends,
        "false_offline": int(offline),
        "lost_nodes": int(lost),
        "errors": sorted(set(load.errors))[:5],
    }
    result["broke"] = first_broken(result, settings.heartbeat_timeout_s)
    return result


def first_broken(r: dict[str, Any], timeout_s: float) -> str | None:
    if not r["ramp_reached"]:
        return (
            f"only {r['running_avg']:.0f} of {r['running']} nodes running {r['ramp_s']:.0f} s after the start"
        )
    if r["false_offline"]:
        return f"{r['false_offline']} hosts taken offline while beating (heartbeat timeout {timeout_s:.0f} s)"
    if r["lost_nodes"]:
        return f"{r['lost_nodes']} nodes lost"
    if r["max_beat_gap_s"] > 0.5 * timeout_s:
        return f"a host's beats {r['max_beat_gap_s']:.1f} s apart (timeout {timeout_s:.0f} s)"
    if (r["lag_p99_s"] or 0) > 1.0:
        return f"event lag p99 {r['lag_p99_s']:.2f} s"
    for what in ("get", "post", "list"):
        if (r[f"{what}_p99_s"] or 0) > 1.0:
            return f"{what.upper()} p99 {r[f'{what}_p99_s']:.2f} s"
    if (
        r["beats_per_s"] < 0.8 * r["beats_offered_per_s"]
        or r["batches_per_s"] < 0.8 * r["batches_offered_per_s"]
    ):
        return "the machine could not offer the load (simulator and server share 2 cores)"
    return None


# ------------------------------------------------------------------------------------------ the report


def ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| hosts | running | pass mean / p99 ms | GET p50 / p99 ms | POST p50 / p99 ms | list p50 / p99 ms "
        "| event lag p50 / p99 ms | commits/s | PostgreSQL / server cores | beats/s (offered) "
        "| batches/s (offered) | first broken |\n" + "| ---" * 12 + " |\n"
    )
    lines = [
        f"| {r['hosts']} | {r['running_avg']:.0f} | {ms(r['pass_mean_s'])} / {ms(r['pass_p99_s'])} "
        f"| {ms(r['get_p50_s'])} / {ms(r['get_p99_s'])} | {ms(r['post_p50_s'])} / {ms(r['post_p99_s'])} "
        f"| {ms(r['list_p50_s'])} / {ms(r['list_p99_s'])} | {ms(r['lag_p50_s'])} / {ms(r['lag_p99_s'])} "
        f"| {r['commits_per_s']:.0f} | {r['postgres_cores']:.2f} / {r['server_cores']:.2f} "
        f"| {r['beats_per_s']:.0f} ({r['beats_offered_per_s']:.0f}) "
        f"| {r['batches_per_s']:.0f} ({r['batches_offered_per_s']:.0f}) | {r['broke'] or 'nothing'} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def steps_of(text: str, seconds: float) -> Iterator[Step]:
    for item in text.split(","):
        hosts, running, *jobs = item.split(":")
        yield Step(int(hosts), int(running), seconds, int(jobs[0]) if jobs else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--doc", type=Path, help="write the curve into this markdown file's table")
    parser.add_argument(
        "--steps", default="10:5,100:50,300:150,1000:500", help="hosts:running[:queued jobs],..."
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="measured per step")
    parser.add_argument("--artifacts", type=Path, default=REPO / "test-artifacts" / "bench" / "scale")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.seconds = "10:10:20", 4.0
    rows = []
    with workdir("tj-bench-scale-", keep_on_error=args.artifacts) as scratch:
        for i, step in enumerate(steps_of(args.steps, args.seconds)):
            row = run_step(step, scratch / f"step-{i}")
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    text = table(rows)
    print(text)
    if args.doc is not None:
        write_doc(args.doc, text, rows)
    result = {
        "name": "scale",
        "title": "The control plane at scale (simulated hosts)",
        "figures": [
            figure(
                f"scheduler pass, {r['hosts']} hosts / {r['running']} running",
                "s",
                [r["pass_mean_s"] or 0.0],
                setup="PostgreSQL + Redis, simulated hosts",
                note=f"first broken: {r['broke'] or 'nothing'}",
            )
            for r in rows
        ],
        "details": text,
        "notes": [],
        "rows": rows,
    }
    write_result(args.json, result)
    return 0


def write_doc(path: Path, text: str, rows: list[dict[str, Any]]) -> None:
    """Replace the generated part of docs/scaling.md (between its markers), keep the prose."""
    info = machine()
    generated = (
        f"Measured {utc_now()} on {info['cpu']} ({info['nproc']} cores), commit {info['commit']}, "
        f"load average before the run {' '.join(info['loadavg'])}; "
        f"`python -m bench.scale --doc {path}`.\n\n{text}"
    )
    begin, end = "<!-- scale:begin -->", "<!-- scale:end -->"
    doc = path.read_text() if path.exists() else f"# Scaling\n\n{begin}\n{end}\n"
    head, _, rest = doc.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{generated}{end}{tail}")


if __name__ == "__main__":
    raise SystemExit(main())
