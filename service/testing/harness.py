"""Real torchjobs processes for tests: `torchjobs up`, or `db upgrade` + `server` + `worker`s.

Nothing here is mocked: the stack is the installed `torchjobs` command, run as subprocesses
against a real SQLite file or a real PostgreSQL database and Redis.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from service.client.api import tls_for
from service.states import JobState

PG_ADMIN_URL = os.environ.get("TORCHJOBS_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TORCHJOBS_TEST_REDIS", "redis://127.0.0.1:6379")
ADMIN_TOKEN = "tj_test_admin_token_0123456789abcdef"
TERMINAL = tuple(str(s) for s in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED))
SCRIPTS = Path(__file__).resolve().parents[2] / "tests" / "scripts"  # a source checkout's


def free_port() -> int:
    """A port free now, from 15000-28999: below the kernel's ephemeral range (32768 up here;
    a port the kernel handed out is free only until it hands it to the next outgoing
    connection: one torchrun's gloo sockets took another's master port that way, EADDRINUSE
    in CI) and below the ports the scheduler gives jobs' masters (29400 up by default)."""
    for _ in range(500):
        port = random.randrange(15000, 29000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 15000-28999")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def job_run_dirs(home: Path, job_id: int) -> list[Path]:
    """The job's run folders on every worker of this home (`runs/<worker>/job-N/attempt-A/node-R`).
    The worker removes them as the job ends: a folder listed and gone before it is read makes
    pathlib's glob raise, so the listing is tried again."""
    for _ in range(20):
        try:
            return sorted(home.glob(f"runs/*/job-{job_id}/attempt-*/node-*"))
        except FileNotFoundError:
            time.sleep(0.05)
    return sorted(home.glob(f"runs/*/job-{job_id}/attempt-*/node-*"))


def create_pg_database(migrated: bool = False) -> str:
    """A fresh PostgreSQL database; returns its URL. `migrated`: a copy of a template that the
    migrations were applied to once (per set of migrations, shared by every test process), not
    a migration run of its own: the same schema, a file copy instead of a few hundred DDL
    statements and an interpreter."""
    import psycopg

    name = f"tj_test_{uuid.uuid4().hex[:10]}"
    template = f' TEMPLATE "{migrated_template()}"' if migrated else ""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{template}')
    return _pg_url(name)


def _pg_url(name: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


@functools.cache
def migrated_template() -> str:
    """The template database at the repository's newest migration, named after a digest of the
    migrations folder (a changed migration makes a new one). Made under a temporary name and
    renamed when complete, so a process racing to make it never copies a half-made one."""
    import hashlib

    import psycopg

    from service.migrate import MIGRATIONS_DIR

    digest = hashlib.sha256()
    for path in sorted(MIGRATIONS_DIR.rglob("*.py")):
        digest.update(path.relative_to(MIGRATIONS_DIR).as_posix().encode() + path.read_bytes())
    name = f"tj_template_{digest.hexdigest()[:16]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    if not exists:
        _make_template(name)
    return name


def _make_template(name: str) -> None:
    import psycopg

    from service.config import Settings
    from service.migrate import upgrade

    partial = f"tj_partial_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{partial}"')
    upgrade(Settings(database_url=_pg_url(partial)))
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        try:
            conn.execute(f'ALTER DATABASE "{partial}" RENAME TO "{name}"')
        except psycopg.errors.DuplicateDatabase:  # another test process made it first
            conn.execute(f'DROP DATABASE "{partial}" WITH (FORCE)')


def at_newest_migration(database_url: str) -> bool:
    from service.config import Settings
    from service.migrate import schema_is_current

    return schema_is_current(Settings(database_url=database_url))


def drop_pg_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def torchjobs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "service.cli.main", *args]


def local_get(url: str, **kwargs: Any) -> httpx.Response:
    """`httpx.get` with the client's TLS choice (`tls_for`): httpx otherwise builds a context
    per call (certifi's bundle parsed: 44 ms of CPU on the AMD machine), and the stacks'
    pollers called several times a second, on the cores the jobs train on."""
    return httpx.get(url, verify=tls_for(url), **kwargs)


@dataclass
class Stack:
    """A running torchjobs deployment under one TORCHJOBS_HOME."""

    home: Path
    env: dict[str, str]
    port: int
    embedded: bool
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    server_args: tuple[str, ...] = ()  # after `server --port N` (`--workers 2`)
    run_as: tuple[str, ...] = ()  # before every command of the stack (`as_user`)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, token: str = ADMIN_TOKEN) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
            verify=tls_for(self.url),
        )

    def _spawn(
        self,
        key: str,
        args: list[str],
        extra_env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        with open(self.home / f"{key}.log", "ab") as log:
            self.procs[key] = subprocess.Popen(
                [*(prefix or []), *self.run_as, *torchjobs_cmd(*args)],
                env={**self.env, **(extra_env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_server(self) -> None:
        if self.embedded:
            # --verbose: every component's log in up.log, where a failing test shows it
            self._spawn(
                "up", ["up", "--port", str(self.port), "--gpus", "2", "--accelerator", "cpu", "--verbose"]
            )
        else:
            self._spawn("server", ["server", "--port", str(self.port), *self.server_args])
        wait_for(self._healthy, 60, "the API server")

    def start_worker(
        self,
        name: str,
        gpus: int = 2,
        address: str = "127.0.0.1",
        extra_env: dict[str, str] | None = None,
        netns: str | None = None,
    ) -> None:
        """A worker process; with `netns`, inside that network namespace (a separate host)."""
        args = ["worker", "--name", name, "--gpus", str(gpus), "--accelerator", "cpu", "--address", address]
        prefix = ["ip", "netns", "exec", netns] if netns else None
        self._spawn(f"worker-{name}", args, extra_env, prefix)
        self.wait_worker_online(name)

    def worker(self, name: str) -> dict[str, Any] | None:
        with self.client() as c:
            items = c.get("/v1/workers").json()["items"]
        return next((w for w in items if w["name"] == name), None)

    def wait_worker_online(self, name: str, timeout: float = 60, started_after: str | None = None) -> None:
        """`started_after`: a restarted worker, not the old row that still looks online until
        its heartbeats are missed."""

        def online() -> bool:
            w = self.worker(name)
            fresh = started_after is None or (w is not None and w["started_at"] > started_after)
            return w is not None and w["state"] == "online" and fresh

        wait_for(online, timeout, f"worker {name} online")

    def _healthy(self) -> bool:
        try:
            return local_get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self, key: str, sig: int = signal.SIGKILL) -> None:
        """Kill a process and its whole session (the worker and every torchrun it started)."""
        proc = self.procs.pop(key)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=60)

    def stop(self) -> None:
        for key in list(self.procs):
            proc = self.procs[key]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for key, proc in list(self.procs.items()):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self.procs.pop(key)

    def submit(self, spec: dict[str, Any], token: str = ADMIN_TOKEN) -> dict[str, Any]:
        with self.client(token) as c:
            resp = c.post("/v1/jobs", json=spec)
        assert resp.status_code == 201, resp.text
        return resp.json()

    def wait_job(
        self, job_id: int, timeout: float = 240, states: tuple[str, ...] = TERMINAL, interval: float = 0.5
    ) -> dict[str, Any]:
        """Polls over one kept-alive connection: a new client per poll costs ~25 ms of CPU (an
        SSL context), twice a second on the cores the job trains on (bench/launch.py measures
        what that did to a job's throughput)."""
        with self.client() as c:

            def done() -> dict[str, Any] | None:
                job = c.get(f"/v1/jobs/{job_id}").json()
                return job if job["state"] in states else None

            try:
                return wait_for(done, timeout, f"job {job_id} to reach {states}", interval=interval)
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}\n{self.describe(job_id)}") from None

    def describe(self, job_id: int) -> str:
        """What a timed-out test needs to say why: the job, its events, the workers, log tails."""
        parts: list[str] = []
        try:
            with self.client() as c:
                parts.append(f"job: {c.get(f'/v1/jobs/{job_id}').text}")
                parts.append(f"events: {c.get(f'/v1/jobs/{job_id}/events').text}")
                parts.append(f"workers: {c.get('/v1/workers').text}")
        except httpx.HTTPError as exc:
            parts.append(f"the API did not answer: {exc!r}")
        for log in [
            *sorted(self.home.glob("*.log")),
            *sorted(p / "agent.log" for p in job_run_dirs(self.home, job_id)),
        ]:
            try:
                tail = log.read_text(errors="replace").splitlines()[-40:]
            except FileNotFoundError:  # its run folder removed meanwhile
                continue
            parts.append(f"--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(parts)

    def events(self, job_id: int) -> list[dict[str, Any]]:
        with self.client() as c:
            return c.get(f"/v1/jobs/{job_id}/events").json()["items"]

    def logs_of(self, key: str) -> str:
        return (self.home / f"{key}.log").read_text(errors="replace")


def make_env(home: Path, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHJOBS_")}
    env.update(
        TORCHJOBS_HOME=str(home),
        TORCHJOBS_ADMIN_TOKEN=ADMIN_TOKEN,
        TORCHJOBS_SCRIPT_ROOTS=str(SCRIPTS),
        TORCHJOBS_HEARTBEAT_INTERVAL_S="1",
        TORCHJOBS_HEARTBEAT_TIMEOUT_S="6",
        TORCHJOBS_CANCEL_GRACE_S="5",
        TORCHJOBS_SCHEDULER_INTERVAL_S="0.5",
        TORCHJOBS_SCHEDULER_IDLE_INTERVAL_S="1",
        OMP_NUM_THREADS="1",
        **_master_ports_of_this_test_process(),
    )
    env.update(overrides)
    return env


def xdist_process() -> tuple[int, int]:
    """(this test process's index, the number of test processes) under pytest-xdist; (0, 1)
    without it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return int(worker.removeprefix("gw") or 0), max(count, 1)


def _master_ports_of_this_test_process() -> dict[str, str]:
    """Under pytest-xdist, each test process's stacks give their jobs masters from a range of
    their own (29400 + 500 per process, below the kernel's ephemeral ports): two stacks'
    schedulers do not know each other's ports, and a multi-node job binds its master on the
    host network."""
    index, count = xdist_process()
    if count == 1:
        return {}
    return {"TORCHJOBS_MASTER_PORT_BASE": str(29400 + 500 * index), "TORCHJOBS_MASTER_PORT_SPAN": "500"}


# A uid's own view of this machine (`as_user`): its Python lives under /root, which only root
# may enter, so a private mount namespace puts an open tmpfs over /root with the Python
# environment bound back, then setpriv becomes the uid (no capabilities left, no groups).
_AS_USER = """set -e
keep=$(mktemp -d)
mount --bind /root "$keep"
mount -t tmpfs -o mode=755 torchjobs-as-user /root
for entry in "$keep"/.pyenv; do
  [ -e "$entry" ] || continue
  mkdir -p "/root/${entry##*/}" && mount --bind "$entry" "/root/${entry##*/}"
done
umount -l "$keep" && rmdir "$keep"
uid=$1; shift
exec setpriv --reuid="$uid" --regid="$uid" --clear-groups -- "$@"
"""


def as_user(uid: int) -> tuple[str, ...]:
    """A command prefix that runs the command as `uid`, a user that is not root (a worker as
    most laptops run it: its sandbox then is bubblewrap in a user namespace). Needs root."""
    return ("unshare", "--mount", "--propagation", "private", "sh", "-c", _AS_USER, "as-user", str(uid))


def embedded_stack(
    home: Path, env: dict[str, str] | None = None, run_as: tuple[str, ...] = (), warm: bool = True
) -> Stack:
    """`torchjobs up` with its local worker online; stopped again if it does not get there.
    `warm=False` as for `production_stack`."""
    env = dict(env) if env is not None else make_env(home)
    if not warm:
        env.setdefault("TORCHJOBS_WARM_AGENT", "false")
    stack = Stack(home=home, env=env, port=free_port(), embedded=True, run_as=run_as)
    try:
        stack.start_server()
        stack.wait_worker_online("local")
    except BaseException:
        stack.stop()
        raise
    return stack


def production_stack(
    home: Path,
    pg_url: str,
    redis_url: str,
    workers: dict[str, int] | None = None,
    server_args: tuple[str, ...] = (),
    warm: bool = True,
    **extra_env: str,
) -> Stack:
    """`warm=False`: no warm spare (`TORCHJOBS_WARM_AGENT=false`), for a stack made for one test
    whose subject is not the launch. A spare costs a second's import of torch in a torchrun
    agent and in a rank server whether or not a job takes it, and a stack built for one test
    leaves its last spare per worker unused: measured on 2 cores, three jobs one after another
    cost 33-37 s of CPU warm and 26-27 s cold, no faster (each next job arrives while the
    spare is still importing)."""
    if not warm:
        extra_env.setdefault("TORCHJOBS_WARM_AGENT", "false")
    env = make_env(
        home,
        TORCHJOBS_DATABASE_URL=pg_url,
        TORCHJOBS_BROKER_URL=redis_url,
        TORCHJOBS_STORAGE_URL=f"file://{home / 'shared-storage'}",
        **extra_env,
    )
    if not at_newest_migration(pg_url):  # a copy of the migrated template is already there
        subprocess.run(torchjobs_cmd("db", "upgrade"), env=env, check=True, capture_output=True)
    stack = Stack(home=home, env=env, port=free_port(), embedded=False, server_args=server_args)
    try:
        stack.start_server()
        for name, gpus in (workers if workers is not None else {"w1": 2}).items():
            stack.start_worker(name, gpus)
    except BaseException:
        stack.stop()  # a stack that did not come up must not outlive the test that wanted it
        raise
    return stack


def pids_of_job(job_id: int, home: Path | None = None) -> list[int]:
    """Every process on this machine whose environment names the job (ranks, agents, loaders),
    and warm torchrun agents working in one of the job's run folders (a warm agent took its
    launch's environment after it started, so /proc shows it the one it started with); and
    every process of a sandbox that holds one of those (ranks see /job there, and a warm
    sandbox's bwrap names the spare folder it was made with, since renamed to the node's).

    With `home`, only those of the stack living there: job ids repeat across test stacks.
    """
    from workers.launcher.procs import pid_namespace, sandbox_run_dirs

    needle = f"TORCHJOBS_JOB_ID={job_id}".encode()
    where = f"TORCHJOBS_CHECKPOINT_DIR={home}".encode() if home else b""
    sandboxes = {ns: run_dir for ns, (_outer, run_dir) in sandbox_run_dirs().items()}
    found: list[int] = []
    members: dict[str, list[int]] = {}
    named: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        ns = pid_namespace(entry) or ""
        if ns in sandboxes:
            members.setdefault(ns, []).append(int(entry))
            if needle in env or f"/job-{job_id}/" in sandboxes[ns]:
                named.add(ns)
        elif (
            (needle in env and (not where or any(v.startswith(where) for v in env)))
            or _warm_agent_of(entry, job_id, home)
            or needle in env
            and _sandbox_of(entry, home)
        ):
            found.append(int(entry))
    for ns in named:
        if home is None or sandboxes[ns].startswith(str(home)):
            found += members[ns]
    return found


def _sandbox_of(pid: str, home: Path | None) -> bool:
    """A sandboxed process whose /job is a run folder under `home` (its mount table says so,
    whether or not the bwrap that made it still lives)."""
    try:
        mounts = Path(f"/proc/{pid}/mountinfo").read_text(errors="replace")
    except OSError:
        return False
    return any(
        line.split()[4] == "/job" and (home is None or line.split()[3].startswith(str(home)))
        for line in mounts.splitlines()
        if len(line.split()) > 4
    )


def _warm_agent_of(pid: str, job_id: int, home: Path | None) -> bool:
    try:
        if b"workers.launcher.warm_agent" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return f"/job-{job_id}/" in cwd + "/" and (home is None or cwd.startswith(str(home)))


def kill_job_processes(job_id: int, home: Path | None = None) -> None:
    for pid in pids_of_job(job_id, home):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def warm_ranks_ready(stack: Stack, spares: int = 1) -> bool:
    """`spares` spare sandboxes of the stack's workers have their rank server listening
    (warm_agent.py): the next node on each starts its ranks warm. A spare's /tmp is
    `torchjobs-spare-NAME` in the worker's temporary folder, NAME being its folder under the
    runs' `.spares`."""
    tmp = Path(stack.env.get("TMPDIR") or tempfile.gettempdir())
    ready = 0
    for run in stack.home.glob("runs/*/.spares/*/run"):
        if (tmp / f"torchjobs-spare-{run.parent.name}" / ".torchjobs-warm-ranks" / "socket").is_socket():
            ready += 1
    return ready >= spares


def wait_warm_ranks(stack: Stack, timeout: float = 120, spares: int = 1) -> None:
    wait_for(lambda: warm_ranks_ready(stack, spares), timeout, f"{spares} spare sandbox(es)' rank server")


def wait_event(
    stack: Stack, job_id: int, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120
) -> Any:
    return wait_for(
        lambda: next((e for e in stack.events(job_id) if predicate(e)), None),
        timeout,
        f"an event of job {job_id}",
        interval=0.3,
    )


def auth(token: str = ADMIN_TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def script_job(path: str, *args: str, name: str | None = None) -> dict[str, Any]:
    """A single-GPU job running one of tests/scripts."""
    return {
        "name": name or path.removesuffix(".py"),
        "mode": "single",
        "gpus_per_node": 1,
        "entrypoint": {"kind": "script", "path": path, "args": list(args)},
    }
