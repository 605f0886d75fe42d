"""`torchjobs up` run as an ordinary uid (`harness.as_user`), as on a laptop: its ranks'
sandbox is bubblewrap in an unprivileged user namespace (`bwrap-userns`). A DDP job trains
and checkpoints there, and another resumes from its file; then exec and forward (contract
§14) enter that sandbox as they enter a root worker's (tests/integration/test_exec.py): the
rank's processes in view, its uid, not one capability, the seccomp filter on before a process
of the job could catch it, nothing of the host, and nothing left when the job ends.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.client.exec_client import ExecResult, run_exec
from service.testing import harness
from service.testing.harness import ADMIN_TOKEN, Stack
from tests.integration import test_exec as root_exec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starts `torchjobs up` as another uid")
USER_UID = 1000
PORT = 5679


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    home = Path(tempfile.mkdtemp(prefix="torchjobs-userns-"))  # not under pytest's root-only folder
    os.chown(home, USER_UID, USER_UID)
    env = harness.make_env(home, HOME=str(home), TORCHJOBS_STREAM_RECHECK_S="1")
    stack = harness.embedded_stack(home, env, run_as=harness.as_user(USER_UID))
    yield stack
    stack.stop()
    harness.wait_for(lambda: _rmtree(home), 30, "the stack's folder to go")


def _rmtree(home: Path) -> bool:
    shutil.rmtree(home, ignore_errors=True)
    return not home.exists()


@pytest.fixture(scope="module")
def alice(stack: Stack) -> str:
    return root_exec._user(stack, "alice")[1]


@pytest.fixture(scope="module")
def job(stack: Stack, alice: str) -> int:
    job_id = int(stack.submit(harness.script_job("serve_tcp.py", str(PORT)), alice)["id"])
    stack.wait_job(job_id, timeout=180, states=("running",))
    harness.wait_for(lambda: _reaches(stack, alice, job_id), 120, "exec to reach the rank")
    return job_id


def _reaches(stack: Stack, token: str, job_id: int) -> bool:
    try:
        return _exec(stack, token, job_id, "true").exit_code == 0
    except Exception as exc:  # "still starting" (a 400) until the sandbox is up
        if getattr(exc, "status_code", None) != 400:
            raise
        return False


def _exec(stack: Stack, token: str, job_id: int, cmd: str, stdin: bytes = b"") -> ExecResult:
    return run_exec(stack.url, token, job_id, cmd, stdin=stdin)


def test_the_worker_is_not_root_and_sandboxes_in_a_user_namespace(stack: Stack) -> None:
    worker = stack.worker("local")
    assert worker is not None and worker["isolation"] == "sandbox", worker
    # its multi-node jobs would share the host's network: another user's wait (contract §7 v3)
    assert worker["multinode_open_to_all"] is False, worker
    assert Path(f"/proc/{stack.procs['up'].pid}").stat().st_uid == USER_UID


def test_a_ddp_job_trains_checkpoints_and_another_resumes_from_it(stack: Stack) -> None:
    """Before the exec tests' job takes a slot: a DDP job on both slots, its checkpoint read
    back over the API, and a `single` job resumed from it (the `module.` prefix stripped)."""
    entry = {"kind": "builtin", "model": "mlp", "dataset": "digits"}
    ddp = stack.submit(
        {"mode": "ddp", "gpus_per_node": 2, "entrypoint": entry, "hyperparameters": {"epochs": 2}}
    )
    done = stack.wait_job(ddp["id"], timeout=240)
    assert done["state"] == "succeeded", stack.describe(ddp["id"])
    checkpoint = done["latest_checkpoint"]
    assert checkpoint is not None and checkpoint["epoch"] == 2, checkpoint
    with stack.client() as c:
        body = c.get(f"/v1/checkpoints/{checkpoint['id']}/download").content
    assert len(body) == checkpoint["size_bytes"] > 0
    resumed = stack.submit(
        {
            "mode": "single",
            "entrypoint": entry,
            "hyperparameters": {"epochs": 3},
            "resume_from": {"checkpoint_id": checkpoint["id"]},
        }
    )
    again = stack.wait_job(resumed["id"], timeout=240)
    assert again["state"] == "succeeded", stack.describe(resumed["id"])
    assert again["progress"]["epoch"] == 3 and again["latest_checkpoint"]["epoch"] == 3
    assert "resuming at epoch 2" in _rank0_log(stack, resumed["id"])


def _rank0_log(stack: Stack, job_id: int) -> str:
    with stack.client() as c:
        return c.get(f"/v1/jobs/{job_id}/logs", params={"node": 0, "rank": 0}).text


def test_exec_is_the_rank_with_nothing_more(stack: Stack, alice: str, job: int) -> None:
    root_exec.output_exit_codes_and_stdin(stack, alice, job)
    rank_uid = _exec(stack, alice, job, "sh -c 'stat -c %u /proc/$(pgrep -f serve_tcp.py | head -1)'")
    assert _exec(stack, alice, job, "id -u").output == rank_uid.output != b"0\n", rank_uid
    ps = _exec(stack, alice, job, "ps -eo pid,args").output.decode()
    assert "serve_tcp.py" in ps, ps  # the rank's processes, as py-spy needs them
    assert "service.cli.main" not in ps and "bwrap" not in ps, ps  # none of the host's
    status = _exec(stack, alice, job, "cat /proc/self/status").output.decode()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2", status
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[caps], 16) == 0, (caps, status)
    assert _exec(stack, alice, job, "pwd").output == b"/job\n"
    assert _exec(stack, alice, job, f"test -e {stack.home}/torchjobs.db").exit_code == 1
    assert (stack.home / "torchjobs.db").exists()
    assert _exec(stack, alice, job, "unshare -U true").exit_code != 0
    assert _exec(stack, alice, job, "mount -t tmpfs none /tmp").exit_code != 0
    env = _exec(stack, alice, job, "env").output.decode()
    assert "TORCHJOBS_JOB_ID=" in env and "TORCHJOBS_HOME" not in env and ADMIN_TOKEN not in env


def test_the_snoop_of_contract_7_finds_nothing_through_exec(stack: Stack, alice: str, job: int) -> None:
    targets = ":".join(
        str(stack.home / p) for p in ("", "admin.token", "torchjobs.db", "runs", "checkpoints")
    )
    victims = ",".join(str(p.pid) for p in stack.procs.values())
    snoop = f"env SNOOP_WALK=1 SNOOP_TARGETS={targets} SNOOP_PIDS={victims}"
    snoop += f" {sys.executable} -I {root_exec.SNOOP}"
    log = _exec(stack, alice, job, snoop).output.decode(errors="replace")
    assert "SNOOP DONE" in log, log[-3000:]
    assert log.count("FILE ") > 10, "the snoop read almost nothing: is it blind?"
    assert ADMIN_TOKEN not in log
    assert "KILLED" not in log and "TRACED" not in log and "WROTE" not in log, log[-3000:]
    assert "CGROUP " not in log, "it listed the host's control groups (other job nodes' among them)"
    assert all(p.poll() is None for p in stack.procs.values())


def test_the_job_cannot_catch_an_exec_before_its_seccomp_filter(stack: Stack, alice: str, job: int) -> None:
    """Here the exec'd process is the job's own uid from the start (a non-root worker's ranks
    are its uid, mapped): what keeps a rank off it while it is unfiltered is that it holds the
    capabilities the join gave it, which the rank has not."""
    root_exec.no_exec_is_caught_unfiltered(stack, alice, job)


def test_the_exec_is_in_a_session_of_its_own(stack: Stack, alice: str, job: int) -> None:
    """The join process outside the job's PID namespace is the job's uid on the host, as a
    non-root worker's ranks are: the process it forks into the job leaves its session and
    process group first, so nothing the job runs can signal it (`kill(0, …)` from the job's
    code before ENTRY's own setsid did; a pty session's ENTRY never calls setsid)."""
    with root_exec._session(stack, alice, job, cmd="sleep 777", tty="true"):
        sleeper = harness.wait_for(lambda: _pid_running(b"sleep\x00777"), 30, "the command")
        entry = _parent(sleeper)
        join = _parent(entry)
        assert b"setns" in _cmdline(join)  # USERNS_JOIN, in the host's PID namespace
        assert os.getsid(entry) != os.getsid(join) and os.getpgid(entry) != os.getpgid(join)
        assert os.readlink(f"/proc/{join}/ns/pid") != os.readlink(f"/proc/{entry}/ns/pid")


def _pid_running(cmdline: bytes) -> int | None:
    return next((pid for pid in _all_pids() if _cmdline(pid).startswith(cmdline)), None)


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def test_py_spy_dumps_the_rank(stack: Stack, alice: str, job: int) -> None:
    spy = Path(sys.executable).with_name("py-spy")
    pid = _exec(stack, alice, job, "pgrep -f serve_tcp.py").output.split()[0].decode()
    dump = _exec(stack, alice, job, f"{spy} dump --pid {pid}")
    assert dump.exit_code == 0, dump.output.decode(errors="replace")
    assert b"serve_tcp.py" in dump.output, dump.output


def test_a_pty_and_a_forward(stack: Stack, alice: str, job: int) -> None:
    with root_exec._session(stack, alice, job, cmd="sh", tty="true") as ws:
        ws.send(json.dumps({"resize": [31, 97]}))
        ws.send(b"stty size; exit 6\n")
        output, code = root_exec._drain(ws)
    assert code == 6 and b"31 97" in output, output
    env = {**stack.env, "TORCHJOBS_URL": stack.url, "TORCHJOBS_TOKEN": alice}
    assert root_exec._refusal(stack, alice, job, port=1)[0] == 400  # nothing listens there
    _forward_once(env, job)


def _forward_once(env: dict[str, str], job: int) -> None:
    cli = subprocess.Popen(
        harness.torchjobs_cmd("forward", str(job), f"0:{PORT}"), env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert cli.stdout is not None
        local = int(cli.stdout.readline().split("127.0.0.1:")[1].split()[0])
        with socket.create_connection(("127.0.0.1", local), timeout=30) as sock:
            stream = sock.makefile("rb")
            assert stream.readline() == b"ready\n"
            sock.sendall(b"userns\n")
            assert stream.readline() == b"echo:userns\n"
    finally:
        cli.terminate()
        cli.wait(timeout=30)


def test_the_session_ends_with_the_job_and_leaves_nothing(stack: Stack, job: int) -> None:
    """Runs last: the job is cancelled under a stubborn exec (it ignores SIGTERM and leaves a
    daemon behind)."""
    result: dict[str, Any] = {}
    # 1009, not test_exec's 1000: the /proc scan below sees every process of the machine, and
    # the root module may hold its own stubborn session at the same time on the other xdist worker
    stubborn = 'sh -c \'trap "" TERM; (trap "" TERM; sleep 1009 &) ; sleep 1009\''

    def hold() -> None:
        with root_exec._session(stack, ADMIN_TOKEN, job, cmd=stubborn) as ws:
            result["drained"] = root_exec._drain(ws)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    harness.wait_for(lambda: root_exec._count(stack, job, b"sleep") >= 2, 30, "the stubborn processes")
    with stack.client() as c:
        assert c.post(f"/v1/jobs/{job}/cancel").status_code in (200, 202)
    stack.wait_job(job, timeout=120)
    holder.join(timeout=60)
    assert not holder.is_alive(), "the session outlived its job"
    assert root_exec._refusal(stack, ADMIN_TOKEN, job, cmd="true")[0] == 400
    harness.wait_for(lambda: not harness.pids_of_job(job, stack.home), 30, "nothing of the job left")
    assert not any(b"sleep\x001009" in _cmdline(pid) for pid in _all_pids())


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
