"""Walls between users (contract §7): a hostile job of one user reaches nothing of the service
or of another user, on real workers, embedded and production.

User B's job walks the filesystem, reads every /proc/*/environ, its own environment and the
service's own paths (home, database, token file, storage, user A's run folder), and tries to
kill and ptrace user A's running ranks and the worker. It does so as a script, from a factory,
and through PYTHONWARNINGS/BROWSER on a builtin job. Nothing secret may show in its logs, and
A's job must succeed. A control run on an unsandboxed worker shows the same probe does find
the admin token there, so a clean log means the wall held, not that the probe was blind.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.client.api import Client
from service.testing import harness
from service.testing.harness import ADMIN_TOKEN, SCRIPTS, Stack

STORAGE_SECRET = "tj-storage-secret-5f0c9a1e"
FACTORY_DIR = Path(__file__).parent.parent / "sandbox_code"
SNOOP = str(SCRIPTS / "snoop.py")
FACTORY = "snoop_factory"
# what torchrun itself gives every rank (torch.distributed.elastic's agent)
TORCHRUN_SETS = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE",
}  # fmt: skip
SNOOP_ENV = {"SNOOP_SCRIPT": SNOOP, "SNOOP_WALK": "1"}


def _worker_env(home: Path) -> dict[str, str]:
    """A worker with a storage credential in its environment and a PYTHONPATH (for the factory)
    that the administrator lets through to ranks."""
    return harness.make_env(
        home,
        AWS_SECRET_ACCESS_KEY=STORAGE_SECRET,
        PYTHONPATH=str(FACTORY_DIR),
        TORCHJOBS_RANK_ENV_ALLOW="OMP_NUM_THREADS,PYTHONPATH",
    )


@pytest.fixture(scope="module", params=["embedded", "production"])
def walled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = Path(tmp_path_factory.mktemp(f"walls-{request.param}"))
    if request.param == "embedded":
        stack = harness.embedded_stack(home, _worker_env(home))
        yield stack
        stack.stop()
        return
    pg_url = harness.create_pg_database(migrated=True)
    env = _worker_env(home)
    extra = {k: env[k] for k in ("AWS_SECRET_ACCESS_KEY", "PYTHONPATH", "TORCHJOBS_RANK_ENV_ALLOW")}
    stack = harness.production_stack(home, pg_url, harness.REDIS_URL + "/12", {"w1": 3}, **extra)
    stack.env["TEST_PG_URL"] = pg_url
    yield stack
    stack.stop()
    harness.drop_pg_database(pg_url)


def _user(stack: Stack, name: str) -> str:
    with stack.client() as c:
        resp = c.post("/v1/users", json={"name": name})
        assert resp.status_code == 201, resp.text
        return str(resp.json()["token"])


def _logs(stack: Stack, job: dict, token: str) -> str:
    """Every rank's whole log, page after page (a snoop prints a lot)."""
    ranks = job["gpus_per_node"] if job["mode"] == "ddp" else 1
    text = []
    with stack.client(token) as c:
        for rank in range(ranks):
            offset = -1
            while True:
                page = c.get(f"/v1/jobs/{job['id']}/logs", params={"rank": rank, "offset": max(offset, 0)})
                text.append(page.text)
                if int(page.headers["X-Next-Offset"]) in (offset, 0) or not page.content:
                    break
                offset = int(page.headers["X-Next-Offset"])
    return "".join(text)


def _secrets(stack: Stack, alice_token: str, alice_job: int) -> dict[str, str]:
    with stack.client(alice_token) as c:
        ckpts = c.get(f"/v1/jobs/{alice_job}/checkpoints").json()["items"]
    assert ckpts, "user A's job left no checkpoint to look for"
    database = stack.env.get("TEST_PG_URL") or f"sqlite:///{stack.home / 'torchjobs.db'}"
    found = {
        "admin token": ADMIN_TOKEN,
        "user A's token": alice_token,
        "storage secret": STORAGE_SECRET,
        "database URL": database,
        "database file header": "SQLite format 3",
    }
    found.update({f"checkpoint {c['id']} SHA-256": c["sha256"] for c in ckpts})
    return found


def _targets(stack: Stack) -> str:
    """The service's own paths, named outright: the walk from / may not even see them."""
    return ":".join(
        str(p)
        for p in (
            stack.home,
            stack.home / "admin.token",
            stack.home / "torchjobs.db",
            stack.home / "checkpoints",
            stack.home / "shared-storage",
            stack.home / "runs",
        )
    )


def _progress(count: int) -> dict:
    entry = {"kind": "script", "path": "progress.py", "args": [str(count), "0.05"]}
    return {"mode": "single", "entrypoint": entry}


def _stack_pids(stack: Stack) -> list[int]:
    return [p.pid for p in stack.procs.values()]


def test_a_hostile_job_reaches_nothing_of_the_service_or_of_another_user(walled: Stack) -> None:
    alice, bob = _user(walled, f"alice{walled.port}"), _user(walled, f"bob{walled.port}")
    builtin = {"kind": "builtin", "model": "cnn", "dataset": "digits"}
    first = walled.submit(
        {"mode": "single", "entrypoint": builtin, "hyperparameters": {"epochs": 2, "num_workers": 0}}, alice
    )
    assert walled.wait_job(first["id"])["state"] == "succeeded"
    secrets = _secrets(walled, alice, first["id"])
    # A's second job keeps running while B's jobs try to kill and trace its ranks
    running = walled.submit(_progress(400), alice)
    harness.wait_event(walled, running["id"], lambda e: e["type"] == "progress", timeout=120)
    victims = harness.pids_of_job(running["id"], walled.home) + _stack_pids(walled)
    assert victims
    env = {**SNOOP_ENV, "SNOOP_TARGETS": _targets(walled), "SNOOP_PIDS": ",".join(map(str, victims))}
    browser = f"{sys.executable} -I {SNOOP} %s"
    jobs = [
        {"mode": "ddp", "gpus_per_node": 2, "entrypoint": {"kind": "script", "path": "snoop.py"}, "env": env},
        {
            "mode": "single",
            "entrypoint": {"kind": "factory", "model": f"{FACTORY}:model", "dataset": f"{FACTORY}:dataset"},
            "hyperparameters": {"epochs": 1, "num_workers": 0},
            "env": env,
        },
        {
            "mode": "single",
            "entrypoint": builtin,
            "hyperparameters": {"epochs": 1, "num_workers": 0},
            # a builtin job, no code at all: Python imports antigravity, which runs $BROWSER
            "env": {**env, "PYTHONWARNINGS": "ignore::antigravity.Warning", "BROWSER": browser},
        },
    ]
    for spec, warm in zip(jobs, (True, True, False), strict=True):
        # a spare's rank server is ready, so the first two start their ranks warm (issue #42):
        # the walls must hold for a rank forked from it exactly as for a cold one. The third
        # sets PYTHONWARNINGS, which Python reads only at start: its ranks start cold.
        harness.wait_warm_ranks(walled)
        job = walled.submit(spec, bob)
        done = walled.wait_job(job["id"], timeout=300)
        log = _logs(walled, done, bob)
        kind = spec["entrypoint"]["kind"]
        assert "SNOOP DONE" in log, f"the {kind} snoop did not finish: {done['error']}\n{log[-3000:]}"
        if warm:
            assert "warm=True" in log and "warm=False" not in log, f"the {kind} snoop's ranks started cold"
        assert log.count("FILE ") > 10, f"the {kind} snoop read almost nothing: is it blind?"
        for what, secret in secrets.items():
            assert secret not in log, f"the {kind} job of user B read the {what}"
        assert "KILLED" not in log and "TRACED" not in log and "WROTE" not in log, log[-3000:]
        assert "CGROUP " not in log, "it listed the host's control groups (other job nodes' among them)"
        assert "uid=0 " not in log  # ranks never run as root
    ended = walled.wait_job(running["id"], timeout=120)
    assert ended["state"] == "succeeded", ended["error"]
    assert all(p.poll() is None for p in walled.procs.values())  # the service lives on


def test_an_unsandboxed_worker_is_readable_so_the_probe_can_see(tmp_path: Path) -> None:
    """The control: with the sandbox off (and unsandboxed workers allowed to take every user's
    jobs), the same probe finds the admin token. This is why test_sandbox's clean logs mean
    something; it is also what TORCHJOBS_ALLOW_UNISOLATED=true costs."""
    env = harness.make_env(tmp_path, TORCHJOBS_SANDBOX="off", TORCHJOBS_ALLOW_UNISOLATED="true")
    stack = harness.embedded_stack(tmp_path, env, warm=False)
    try:
        bob = _user(stack, "bob")
        snoop = {**SNOOP_ENV, "SNOOP_WALK": "0", "SNOOP_TARGETS": _targets(stack)}
        spec = {"mode": "single", "entrypoint": {"kind": "script", "path": "snoop.py"}, "env": snoop}
        job = stack.submit(spec, bob)
        done = stack.wait_job(job["id"])
        log = _logs(stack, done, bob)
        assert "SNOOP DONE" in log and ADMIN_TOKEN in log
        assert "CGROUP " in log  # the host's control groups: what the sandbox hides
        with stack.client() as c:
            (worker,) = c.get("/v1/workers").json()["items"]
        assert worker["isolation"] == "none" and worker["open_to_all"] is True
        assert worker["multinode_open_to_all"] is True  # what it takes is open_to_all's to say
    finally:
        stack.stop()


def test_an_unsandboxed_worker_takes_only_the_admins_jobs(tmp_path: Path) -> None:
    env = harness.make_env(tmp_path, TORCHJOBS_SANDBOX="off")
    stack = harness.embedded_stack(tmp_path, env, warm=False)
    try:
        bob = _user(stack, "bob")
        spec = {"mode": "single", "entrypoint": {"kind": "script", "path": "hello.py"}}
        waiting = stack.submit(spec, bob)
        admins = stack.submit(spec)
        assert stack.wait_job(admins["id"])["state"] == "succeeded"
        with stack.client(bob) as c:
            view = c.get(f"/v1/jobs/{waiting['id']}").json()
            (worker,) = c.get("/v1/workers").json()["items"]
        assert view["state"] == "queued" and "without a sandbox" in view["pending_reason"]
        assert worker["isolation"] == "none" and "TORCHJOBS_SANDBOX=off" in worker["isolation_detail"]
        assert worker["open_to_all"] is False
        assert "ranks cannot be sandboxed here" in stack.logs_of("up")
    finally:
        stack.stop()


def test_workers_show_their_isolation_and_only_the_callers_jobs(walled: Stack) -> None:
    carol, dave = _user(walled, f"carol{walled.port}"), _user(walled, f"dave{walled.port}")
    # 200 s each (cancelled below): both must still run when the second has started, on a
    # machine busy enough that 10 s jobs did not (the first had ended)
    mine, theirs = walled.submit(_progress(4000), carol), walled.submit(_progress(4000), dave)
    for job in (mine, theirs):
        harness.wait_event(walled, job["id"], lambda e: e["type"] == "progress", timeout=120)
    both = {mine["id"], theirs["id"]}
    with walled.client() as c:  # the workers' job lists follow their reports: wait for both

        def listing() -> list[dict] | None:
            items = c.get("/v1/workers").json()["items"]
            return items if both <= {j for w in items for j in w["jobs"]} else None

        everything = harness.wait_for(listing, 30, f"the admin's worker list to show jobs {both}")
    with walled.client(carol) as c:
        seen = c.get("/v1/workers").json()["items"]
    with walled.client() as c:
        for job in (mine, theirs):
            c.post(f"/v1/jobs/{job['id']}/cancel")
    assert all(w["isolation"] == "sandbox" for w in seen)
    assert all(w["gpu_ids"] == [str(i) for i in range(w["gpus"])] for w in seen)  # CPU slots: themselves
    carol_sees = {j for w in seen for j in w["jobs"]}
    admin_sees = {j for w in everything for j in w["jobs"]}
    assert mine["id"] in carol_sees and theirs["id"] not in carol_sees
    assert {mine["id"], theirs["id"]} <= admin_sees
    # the other user's GPUs still count as busy for her
    assert sum(w["gpus_free"] for w in seen) == sum(w["gpus_free"] for w in everything)


def test_a_rank_sees_a_private_view_and_runs_as_another_user(walled: Stack) -> None:
    """What is there, not only what is not: the contract's variables, a private HOME and TMPDIR,
    its own processes only, the Python environment read-only."""
    job = walled.submit({"mode": "single", "entrypoint": {"kind": "script", "path": "view_probe.py"}})
    done = walled.wait_job(job["id"])
    assert done["state"] == "succeeded", done["error"]
    with walled.client() as c:
        log = c.get(f"/v1/jobs/{job['id']}/logs").text
    facts = dict(line.split("=", 1) for line in log.splitlines() if "=" in line and line.startswith("view."))
    assert facts["view.uid"] != "0" and facts["view.cwd"] == "/job"
    assert facts["view.home"] == "/job/home" and facts["view.tmpdir"] == "/tmp"
    assert facts["view.home_writable"] == "True" and facts["view.prefix_writable"] == "False"
    assert int(facts["view.processes"]) <= 5  # PID 1, the agent, the rank and what it started
    ours = {
        n
        for n in facts["view.env"].split(",")
        if n not in TORCHRUN_SETS and not n.startswith("TORCHELASTIC_")
    }
    assert ours == {
        "CUDA_VISIBLE_DEVICES", "HOME", "LANG", "OMP_NUM_THREADS", "PATH", "PYTHONPATH",
        "PYTHONUNBUFFERED", "TMPDIR", "TORCHJOBS_ACCELERATOR", "TORCHJOBS_ATTEMPT",
        "TORCHJOBS_CHECKPOINT_DIR", "TORCHJOBS_EVENTS", "TORCHJOBS_JOB_ID",
        "TORCHJOBS_PREFLIGHT_TIMEOUT_S", "TORCHJOBS_SLOTS", "TORCHJOBS_WORKER_SLOTS", "USER", "LOGNAME",
    }  # fmt: skip


# ---------------------------------------------------------------- a job's code and environment

HOLDER = """
import hashlib
import os
import sys
import time

import tabulate

def digest(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()

mine, theirs = digest("data.txt"), digest(tabulate.__file__)  # readable: its code and its environment
print(f"HOLDING tabulate={tabulate.__file__} data={mine}", flush=True)
deadline = time.monotonic() + 240
while not os.path.exists("release"):  # the test makes it, from the host, once the other job ended
    if time.monotonic() > deadline:
        sys.exit("never released")
    time.sleep(0.2)
intact = digest("data.txt") == mine and digest(tabulate.__file__) == theirs
print(f"INTACT {intact} {sorted(os.listdir('.'))}", flush=True)
"""

WRITER = """
import errno
import os

import tabulate

print(f"WRITER tabulate={tabulate.__file__}", flush=True)

def first_file(folder):
    for root, _dirs, files in os.walk(folder):
        for name in files:
            return os.path.join(root, name)
    return os.path.join(folder, "__init__.py")  # none seen: try a name anyway

def attempts(folder):
    yield "create", lambda: open(os.path.join(folder, "intruder.txt"), "x").write("x")
    yield "mkdir", lambda: os.mkdir(os.path.join(folder, "intruder"))
    yield "overwrite", lambda: open(first_file(folder), "r+b").write(b"#")
    yield "delete", lambda: os.unlink(first_file(folder))

for folder in filter(None, os.environ["TARGETS"].split(":")):
    for how, attempt in attempts(folder):
        try:
            attempt()
            print(f"TRY {folder} {how} WROTE", flush=True)
        except OSError as exc:
            print(f"TRY {folder} {how} refused {errno.errorcode.get(exc.errno, exc.errno)}", flush=True)
"""


def _push(stack: Stack, token: str, folder: Path, files: dict[str, str]) -> str:
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    with Client(stack.url, token) as client:
        return str(client.push_code(folder)["id"])


def _hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_jobs_code_and_environment_are_read_only_to_another_users_job(
    walled: Stack, tmp_path: Path
) -> None:
    """Alice's job reads its code copy and its built environment and keeps running; Bob's job,
    with the very same `environment.pip` (so the very same environment folder, which every
    sandbox sees read-only), tries to create, overwrite and delete files in it, in Alice's code
    copy and in the worker's unpacked copy of her code. Every try is refused, and nothing of
    hers changed. Both run as the same sandbox user: what stops Bob is the mounts, not the uid."""
    alice, bob = _user(walled, f"erin{walled.port}"), _user(walled, f"frank{walled.port}")
    pip = {"pip": ["tabulate==0.10.0"]}
    hers = _push(walled, alice, tmp_path / "hers", {"hold.py": HOLDER, "data.txt": "alice's data\n"})
    his = _push(walled, bob, tmp_path / "his", {"write.py": WRITER})
    script = {"kind": "script", "path": "hold.py", "args": []}
    holding = walled.submit({"mode": "single", "code": hers, "entrypoint": script, "environment": pip}, alice)

    def holding_log() -> str:
        with walled.client(alice) as c:
            return c.get(f"/v1/jobs/{holding['id']}/logs").text

    found = harness.wait_for(
        lambda: re.search(r"HOLDING tabulate=(\S+)", holding_log()), 240, "alice's job to hold"
    )
    site = Path(found[1]).parent  # ENVS/KEY/site/tabulate: the same path on the host and inside
    environment = site.parent.parent
    assert environment.parent == walled.home / "cache" / "environments", site
    (copy,) = walled.home.glob(f"runs/*/job-{holding['id']}/attempt-*/node-0/workdir")
    cached = walled.home / "cache" / "code" / hers
    assert (copy / "data.txt").is_file() and (cached / "data.txt").is_file()
    before = {folder: _hashes(folder) for folder in (environment, copy, cached)}
    targets = [site, site.parent, environment.parent, copy, cached]

    spec = {
        "mode": "single",
        "code": his,
        "entrypoint": {"kind": "script", "path": "write.py", "args": []},
        "environment": pip,
        "env": {"TARGETS": ":".join(map(str, targets))},
    }
    writer = walled.wait_job(walled.submit(spec, bob)["id"])
    assert writer["state"] == "succeeded", walled.describe(writer["id"])
    log = _logs(walled, writer, bob)
    assert f"WRITER tabulate={site}/__init__.py" in log  # he reads her environment: it is shared
    tries = re.findall(r"^TRY (\S+) (\w+) (.+)$", log, re.MULTILINE)
    assert len(tries) == 4 * len(targets), log
    for folder, how, result in tries:
        assert "WROTE" not in result, (folder, how)
        if folder == str(environment.parent) and how == "overwrite":
            # the environments' folder cannot be listed (0711): the walk names no file of it
            assert result == "refused ENOENT", (folder, how, result)
        elif folder in (str(site), str(site.parent), str(environment.parent)):
            assert result in ("refused EROFS", "refused EACCES"), (folder, how, result)  # seen, read-only
        else:  # her code copy and the worker's cache are not even in his view
            assert result in ("refused ENOENT", "refused EROFS", "refused EACCES"), (folder, how, result)
    assert {folder: _hashes(folder) for folder in before} == before
    assert not list(walled.home.rglob("intruder*"))

    (copy / "release").touch()
    done = walled.wait_job(holding["id"])
    assert done["state"] == "succeeded", walled.describe(holding["id"])
    assert "INTACT True ['data.txt', 'hold.py', 'release']" in holding_log()
