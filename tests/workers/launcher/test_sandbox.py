"""The sandbox itself, run for real (bubblewrap): the uid, the view, the processes, the end.

Both mechanisms are built here as root (this machine's tests run as root): the root worker's
(`bwrap-setuid`: setpriv to an unprivileged uid) and the non-root worker's (`bwrap-userns`:
a user namespace), the latter started by root, since no other user can reach this machine's
Python under /root. tests/integration/test_sandbox.py covers whole jobs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from service.nodes.values import NodeKey
from service.testing.harness import free_port
from workers.environments import prepare_envs_root
from workers.launcher import lifeline, procs, sandbox
from workers.launcher.agents import WarmAgentPool
from workers.launcher.command import NodeLaunch, build_launch, resume_dir_of
from workers.launcher.sandbox import ENV_FILE, Isolation, Mounts
from workers.launcher.sandbox_spares import SpareSandboxes
from workers.launcher.supervisor import Hooks, NodeSupervisor, warm_agents
from workers.launcher.warm_agent import RANK_SOCKET

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="builds both sandboxes as root")


def _iso(method: str) -> Isolation:
    bwrap = sandbox.find_bwrap()
    assert bwrap, "bubblewrap is a dependency of torchjobs"
    if method == "bwrap-setuid":
        return Isolation(kind="sandbox", method=method, bwrap=bwrap, uid=65534, gid=65534)
    return Isolation(kind="sandbox", method=method, bwrap=bwrap)


def _run_dir(tmp_path: Path, iso: Isolation, env: dict[str, str]) -> Mounts:
    run = tmp_path / "run"
    run.mkdir()
    (run / ENV_FILE).write_text(json.dumps(env))
    if iso.uid is not None:
        for path in (run, run / ENV_FILE):
            os.chown(path, iso.uid, iso.gid or iso.uid)
    resume = tmp_path / "secret-cache" / "abc.pt"
    resume.parent.mkdir()
    resume.write_bytes(b"weights")
    resume.chmod(0o644)
    (tmp_path / "admin.token").write_text("tj_secret")
    python = sandbox.python_paths(sys.executable)
    return Mounts(run_dir=run, tmp_dir=run, resume=str(resume), read_only=python)


PROBE = r"""
import json, os, sys
def can(fn):
    try:
        fn(); return True
    except OSError:
        return False
home = os.path.dirname(os.path.dirname(os.environ["SECRET"]))
print(json.dumps({
    "uid": os.getuid(),
    "env": sorted(os.environ),
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "cwd": os.getcwd(),
    "resume": open("/resume/abc.pt", "rb").read().decode(),
    "resume_writable": can(lambda: open("/resume/abc.pt", "ab").close()),
    "job_writable": can(lambda: open("/job/x", "w").close()),
    "prefix_writable": can(lambda: open(os.path.join(sys.prefix, "x"), "w").close()),
    "secret_visible": os.path.exists(os.environ["SECRET"]),
    "root_listing": sorted(os.listdir("/")),
    "etc": sorted(os.listdir("/etc")),
    "cgroups": sorted(os.listdir("/sys/fs/cgroup")) if os.path.isdir("/sys/fs/cgroup") else None,
}))
"""


@pytest.mark.parametrize("method", ["bwrap-setuid", "bwrap-userns"])
def test_a_sandbox_has_its_own_uid_view_and_processes(tmp_path: Path, method: str) -> None:
    iso = _iso(method)
    secret = str(tmp_path / "admin.token")
    mounts = _run_dir(tmp_path, iso, {"PATH": "/usr/bin:/bin", "SECRET": secret, "MINE": "1"})
    argv = sandbox.wrap([sys.executable, "-c", PROBE], iso, mounts, sys.executable)
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={"LEAK": "worker"}, pass_fds=lifeline.pass_fds()
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["uid"] == (65534 if method == "bwrap-setuid" else 1000)
    # the file's environment, nothing of bwrap's (LC_CTYPE: Python's own C-locale coercion)
    assert [k for k in seen["env"] if k != "LC_CTYPE"] == ["MINE", "PATH", "SECRET"]
    assert seen["pids"] == [1, 2]  # the sandbox's PID 1 (sandbox.ENTRY) and itself
    assert seen["cwd"] == "/job" and seen["resume"] == "weights"
    assert not seen["resume_writable"] and not seen["prefix_writable"] and seen["job_writable"]
    assert not seen["secret_visible"]
    assert "shadow" not in seen["etc"] and "root" in seen["root_listing"]
    assert os.listdir("/sys/fs/cgroup"), "the host's control groups: what the sandbox must hide"
    assert seen["cgroups"] == []  # no job node's group, no host service's


def test_killing_pid_1_ends_the_whole_sandbox_even_what_ignores_sigterm(tmp_path: Path) -> None:
    iso = _iso("bwrap-setuid")
    mounts = _run_dir(tmp_path, iso, {"PATH": "/usr/bin:/bin"})
    stubborn = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    stubborn += "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    stubborn += "signal.signal(signal.SIGTERM, signal.SIG_IGN); open(\\'/tmp/ready\\', \\'w\\').close(); "
    stubborn += "time.sleep(600)'], start_new_session=True);"
    stubborn += "time.sleep(600)"
    argv = sandbox.wrap([sys.executable, "-c", stubborn], iso, mounts, sys.executable)
    outer = subprocess.Popen(argv, env={}, start_new_session=True, pass_fds=lifeline.pass_fds())
    try:
        deadline = time.monotonic() + 30
        while True:
            ns = procs.sandbox_namespace(outer.pid)
            inside = procs.pids_in_namespace(ns) if ns else []
            ready = (mounts.tmp_dir / "ready").exists()  # both ignore SIGTERM by then
            if (ready and len(inside) >= 3) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(inside) >= 3, "the sandbox's PID 1 and two processes did not start"
        procs.signal_all(inside, signal.SIGTERM)  # ignored by both
        time.sleep(0.5)
        assert procs.pids_in_namespace(ns) == inside
        found = procs.sandbox_run_dirs()
        assert found[ns] == (outer.pid, str(mounts.run_dir) + "/")
        assert procs.kill_under(str(tmp_path) + "/") >= 1  # what a restarted worker does
        outer.wait(timeout=10)
        deadline = time.monotonic() + 10
        while procs.pids_in_namespace(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert procs.pids_in_namespace(ns) == []
    finally:
        outer.kill()


# a worker: starts one sandbox, holds its lifeline, is SIGKILLed by the test
WORKER = """
import json, subprocess, sys, time
from pathlib import Path
from workers.launcher import lifeline, sandbox
iso, run, read_only, argv = json.loads(sys.argv[1])
mounts = sandbox.Mounts(run_dir=Path(run), tmp_dir=Path(run), read_only=tuple(read_only))
wrapped = sandbox.wrap(argv, sandbox.Isolation(**iso), mounts, sys.executable)
subprocess.Popen(wrapped, env={}, start_new_session=True, pass_fds=lifeline.pass_fds())
time.sleep(600)
"""
STUBBORN_RANK = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def test_a_killed_worker_takes_its_sandboxes_with_it(tmp_path: Path) -> None:
    """The worker SIGKILLed, torchrun alive, its rank ignoring SIGTERM, and no worker coming
    back: the sandbox still ends, after the grace. PR_SET_PDEATHSIG never reached torchrun
    here (bwrap's outer process may not signal the job's uid): all three ran on, unseen."""
    iso = _iso("bwrap-setuid")
    mounts = _run_dir(tmp_path, iso, {"PATH": "/usr/bin:/bin", "HOME": "/job"})
    (mounts.run_dir / "rank.py").write_text(STUBBORN_RANK)
    (mounts.run_dir / "rank.py").chmod(0o644)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    argv.append("/job/rank.py")
    what = [{"kind": iso.kind, "method": iso.method, "bwrap": iso.bwrap, "uid": iso.uid, "gid": iso.gid}]
    what += [str(mounts.run_dir), list(mounts.read_only), argv]
    worker = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(what)], cwd=Path(__file__).parents[3])
    try:
        ns = _wait_for_rank(mounts.run_dir)
        worker.kill()
        worker.wait()
        deadline = time.monotonic() + lifeline.ORPHAN_GRACE_S + 20
        while procs.pids_in_namespace(ns) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert procs.pids_in_namespace(ns) == [], "the sandbox outlived its worker"
    finally:
        worker.kill()
        procs.kill_under(str(tmp_path) + "/")


def _wait_for_rank(run_dir: Path) -> str:
    """The sandbox's namespace, once it holds PID 1, torchrun and the rank."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for ns, (_outer, bound) in procs.sandbox_run_dirs().items():
            if bound == str(run_dir) + "/" and len(procs.pids_in_namespace(ns)) >= 3:
                return ns
        time.sleep(0.2)
    raise AssertionError("the sandbox's rank did not start")


def test_detect_says_why_there_is_no_sandbox() -> None:
    off = sandbox.detect("off", "torchjobs-run")
    assert off.kind == "none" and "TORCHJOBS_SANDBOX=off" in off.detail
    here = sandbox.detect("auto", "torchjobs-run")
    assert here.kind == "sandbox" and here.method == "bwrap-setuid" and here.uid not in (None, 0)


WHOAMI = """
import os, shutil, sys
env = os.environ
print(f"uid={os.getuid()} cwd={os.getcwd()} home={env['HOME']} flag={env.get('MY_FLAG')}", flush=True)
print("resume=" + open(os.environ["TORCHJOBS_RESUME_FROM"]).read(), flush=True)
print("processes=" + ",".join(sorted(p for p in os.listdir("/proc") if p.isdigit())), flush=True)
print(f"warm={'workers.runtime.warm_rank' in sys.modules} ns={os.readlink('/proc/self/ns/pid')}", flush=True)
ckpts = os.environ["TORCHJOBS_CHECKPOINT_DIR"]
with open(os.path.join(ckpts, "final.pt.tmp"), "w") as fh:
    fh.write("weights")
os.rename(os.path.join(ckpts, "final.pt.tmp"), os.path.join(ckpts, "final.pt"))
"""


class Node:
    """One node of a script job through the whole supervisor, from `pool`."""

    def __init__(self, tmp_path: Path, pool: WarmAgentPool, iso: Isolation, job_id: int) -> None:
        code = tmp_path / "code"
        self.resume = tmp_path / "cache" / "abc.pt"
        self.run_dir = tmp_path / "runs" / f"job-{job_id}" / "attempt-1" / "node-0"
        launch = NodeLaunch(
            job_id=job_id, attempt=1, node_rank=0, nnodes=1, mode="single", gpus=(0,), accelerator="cpu",
            master_addr="127.0.0.1", master_port=free_port(), entrypoint={"kind": "script", "path": "x.py"},
            hyperparameters=None, script_path=str(code / "whoami.py"), run_dir=self.run_dir,
            python=sys.executable, tmp_root=Path(tempfile.gettempdir()), resume_path=str(self.resume),
            isolation=iso, read_only=_node_read_only(tmp_path), user_env={"MY_FLAG": "on"},
        )  # fmt: skip
        self.batches: list = []
        self.stored: list[str] = []
        self.node = NodeSupervisor(
            key=NodeKey(job_id=job_id, attempt=1, node_rank=0),
            plan=build_launch(launch),
            mode="single",
            gpus=1,
            hooks=Hooks(
                write_batch=lambda b: self.batches.append(b) or None,
                record_checkpoint=lambda f, n, m, v: self.stored.append(f.read().decode()),
                job_control=lambda: ("running", 1),
            ),
            grace_s=5,
            shutdown=threading.Event(),
            agents=pool,
        )

    def run(self) -> str:
        """The rank's output; the node has succeeded."""
        outcome = self.node.run()
        out = b"".join(data for b in self.batches for _, _, data in b.logs).decode()
        assert outcome.state == "succeeded", (outcome.error, out)
        self.agent_log = (self.run_dir / "agent.log").read_text()
        return out


def _node_files(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "whoami.py").write_text(WHOAMI)
    resume = tmp_path / "cache" / "abc.pt"
    resume.parent.mkdir()
    resume.write_text("weights-1")
    resume.chmod(0o644)


def _node_read_only(tmp_path: Path) -> tuple[str, ...]:
    return (*sandbox.python_paths(sys.executable), str(tmp_path / "code"))


def _spare_pool(tmp_path: Path, iso: Isolation, warm: str) -> WarmAgentPool:
    """cold, warm (a waiting torchrun agent) or warm-ranks (and its rank server), ready."""
    runs = tmp_path / "runs"
    tmp_root = Path(tempfile.gettempdir())
    read_only = _node_read_only(tmp_path)
    ranks = warm == "warm-ranks"
    spares = SpareSandboxes(iso, read_only, runs / ".spares", tmp_root, sys.executable, warm_ranks=ranks)
    pool = warm_agents({}, enabled=warm != "cold", sandboxes=spares)
    deadline = time.monotonic() + 120
    while warm != "cold" and not (pool.ready() and (warm == "warm" or _rank_server_ready(runs, tmp_root))):
        assert time.monotonic() < deadline, "no warm sandbox started"
        time.sleep(0.05)
    return pool


def _rank_server_ready(runs: Path, tmp_root: Path) -> bool:
    """A spare's rank server listens (warm_agent.RANK_SOCKET, in the spare's own /tmp)."""
    spares = [p.name for p in (runs / ".spares").glob("*") if (p / "run").is_dir()]
    sockets = [tmp_root / f"torchjobs-spare-{name}" / RANK_SOCKET.relative_to("/tmp") for name in spares]
    return any(s.is_socket() for s in sockets)


@pytest.mark.parametrize("warm", ["warm", "warm-ranks", "cold"])
def test_a_node_runs_in_a_sandbox_warm_or_cold_and_leaves_nothing(tmp_path: Path, warm: str) -> None:
    """The whole supervisor: a warm spare sandbox is moved under the node (its folders renamed
    to the node's), or a cold one is made for it; either way the rank sees /job, its resume
    file and only its own processes, and the node's end removes every folder. With warm
    ranks, the rank is forked from the spare's rank server, and says so in the agent's log."""
    iso = sandbox.detect("auto", "torchjobs-run")
    _node_files(tmp_path)
    pool = _spare_pool(tmp_path, iso, warm)
    try:
        node = Node(tmp_path, pool, iso, job_id=1)
        out = node.run()
        assert (pool.warm_starts, pool.cold_starts) == ((0, 1) if warm == "cold" else (1, 0))
        assert f"uid={iso.uid} cwd=/job home=/job/home flag=on" in out
        assert "resume=weights-1" in out and node.stored == ["weights"]
        assert f"warm={warm == 'warm-ranks'} " in out
        assert ("a rank starts warm" in node.agent_log) == (warm == "warm-ranks"), node.agent_log
        processes = out.split("processes=")[1].split()[0].split(",")
        # PID 1, the agent and the rank (and its shell); with warm ranks, the server and the
        # rank's client besides
        assert len(processes) <= (6 if warm == "warm-ranks" else 4)
        node.node.cleanup()
        assert not node.run_dir.exists() and not resume_dir_of(node.run_dir).exists()
    finally:
        pool.close()
    assert not any((tmp_path / "runs" / ".spares").glob("*/run"))  # the next spare, discarded with the pool


def test_a_rank_server_serves_one_node_and_dies_with_it(tmp_path: Path) -> None:
    """Two nodes in a row from one worker's pool, both warm: each rank was forked by the
    server of its own spare sandbox (another PID namespace), and after a node's end nothing of
    its sandbox (server included) is left."""
    iso = sandbox.detect("auto", "torchjobs-run")
    _node_files(tmp_path)
    pool = _spare_pool(tmp_path, iso, "warm-ranks")
    namespaces = []
    try:
        for job_id in (1, 2):
            if job_id == 2:
                deadline = time.monotonic() + 120
                tmp_root = Path(tempfile.gettempdir())
                while not (pool.ready() and _rank_server_ready(tmp_path / "runs", tmp_root)):
                    assert time.monotonic() < deadline, "no second warm sandbox started"
                    time.sleep(0.05)
            node = Node(tmp_path, pool, iso, job_id=job_id)
            out = node.run()
            assert "warm=True " in out, node.agent_log
            namespaces.append(out.split(" ns=")[1].split()[0])
            node.node.cleanup()
            assert procs.pids_in_namespace(namespaces[-1]) == []
    finally:
        pool.close()
    assert namespaces[0] != namespaces[1]


ENVS_PROBE = r"""
import json, os, sys
envs = sys.argv[1]
def listing():
    try:
        return sorted(os.listdir(envs))
    except OSError as exc:
        return exc.__class__.__name__
print(json.dumps({
    "listing": listing(),
    "own": open(os.path.join(envs, "k-own", "site", "mine.py")).read(),
    "guessed": os.path.exists(os.path.join(envs, "k-guess")),
}))
"""


def test_a_job_reads_its_own_environment_and_cannot_list_the_others(tmp_path: Path) -> None:
    """The built environments' folder as the worker prepares it (0711), bound read-only in a
    sandbox as the root worker's: the rank reads its own environment by its name, and cannot
    list the folder to learn which others the host holds."""
    iso = _iso("bwrap-setuid")
    envs = prepare_envs_root(tmp_path / "cache" / "environments")
    for key in ("k-own", "k-other"):
        (envs / key / "site").mkdir(parents=True)
        (envs / key / "site" / "mine.py").write_text(f"# {key}\n")
    mounts = _run_dir(tmp_path, iso, {"PATH": "/usr/bin:/bin"})
    mounts = dataclasses.replace(mounts, read_only=(*mounts.read_only, str(envs)))  # as agent.py binds it
    argv = sandbox.wrap([sys.executable, "-c", ENVS_PROBE, str(envs)], iso, mounts, sys.executable)
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={}, pass_fds=lifeline.pass_fds()
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"listing": "PermissionError", "own": "# k-own\n", "guessed": False}
    assert sorted(os.listdir(envs)) == ["k-other", "k-own"]  # the worker (root) still lists it
