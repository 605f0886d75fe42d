"""Into a running job (contract §14): exec, a pty and port forwarding, inside the rank's own
sandbox, on a real root worker (`torchjobs up` as root, bwrap-setuid with a uid per node).

One long job (tests/scripts/serve_tcp.py, serving TCP on 127.0.0.1:PORT in its own network
namespace) carries every test until the last one cancels it: then the sessions end, and
nothing an exec started is left.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from service.client.errors import ApiError
from service.client.exec_client import ExecResult, run_exec, socket_url
from service.nodes import exec_link
from service.testing import harness
from service.testing.harness import ADMIN_TOKEN, Stack

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="exec enters a root worker's sandbox (bwrap-setuid)"
)
PORT = 5678
HTTP_PORT = 5690
MAX_PER_USER = 3
SNOOP = str(harness.SCRIPTS / "snoop.py")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = Path(tmp_path_factory.mktemp("exec"))
    env = harness.make_env(
        home, TORCHJOBS_STREAM_RECHECK_S="1", TORCHJOBS_EXEC_MAX_PER_USER=str(MAX_PER_USER)
    )
    stack = harness.embedded_stack(home, env)
    yield stack
    stack.stop()


def _user(stack: Stack, name: str) -> tuple[int, str]:
    with stack.client() as c:
        resp = c.post("/v1/users", json={"name": name})
    assert resp.status_code == 201, resp.text
    return int(resp.json()["id"]), str(resp.json()["token"])


@pytest.fixture(scope="module")
def alice(stack: Stack) -> str:
    return _user(stack, "alice")[1]


@pytest.fixture(scope="module")
def job(stack: Stack, alice: str) -> int:
    """alice's serving job, once exec reaches its rank (its sandbox takes a moment)."""
    return _running_job(stack, alice)


def _running_job(stack: Stack, token: str) -> int:
    job_id = int(stack.submit(harness.script_job("serve_tcp.py", str(PORT)), token)["id"])
    stack.wait_job(job_id, timeout=180, states=("running",))

    def reached() -> bool:
        try:
            return _exec(stack, token, job_id, "true").exit_code == 0
        except ApiError as exc:
            if exc.status_code != 400:  # "still starting" may come, nothing else
                raise
            return False

    harness.wait_for(reached, 120, "exec to reach the rank")
    return job_id


def _exec(stack: Stack, token: str, job_id: int, cmd: str, stdin: bytes = b"", **where: int) -> ExecResult:
    return run_exec(stack.url, token, job_id, cmd, stdin=stdin, **where)


def _refusal(stack: Stack, token: str | None, job_id: int, **params: Any) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    path = f"/v1/jobs/{job_id}/{'forward' if 'port' in params else 'exec'}"
    try:
        with connect(socket_url(stack.url, path, params), additional_headers=headers, proxy=None):
            pass
    except InvalidStatus as exc:
        return exc.response.status_code, json.loads(exc.response.body or b"{}").get("detail", "")
    raise AssertionError(f"{path} {params} was not refused")


def _session(stack: Stack, token: str, job_id: int, **params: Any) -> ClientConnection:
    headers = {"Authorization": f"Bearer {token}"}
    return connect(
        socket_url(stack.url, f"/v1/jobs/{job_id}/exec", params), additional_headers=headers, proxy=None
    )


def _rank_uid(stack: Stack, job_id: int) -> int:
    """The uid of the rank running serve_tcp.py, as the host sees it."""
    for pid in harness.pids_of_job(job_id, stack.home):
        try:
            if b"serve_tcp.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return Path(f"/proc/{pid}").stat().st_uid
        except OSError:
            continue
    raise AssertionError("the rank's process was not found")


def test_exec_output_exit_codes_and_stdin(stack: Stack, alice: str, job: int) -> None:
    output_exit_codes_and_stdin(stack, alice, job)


def output_exit_codes_and_stdin(stack: Stack, token: str, job: int) -> None:
    """(also used by tests/integration/test_non_root.py)"""
    assert _exec(stack, token, job, "echo hi") == ExecResult(b"hi\n", 0)
    assert _exec(stack, token, job, "sh -c 'exit 3'").exit_code == 3
    data = os.urandom(200_000)
    assert _exec(stack, token, job, "cat", stdin=data) == ExecResult(data, 0)
    missing = _exec(stack, token, job, "no-such-command")
    assert missing.exit_code == 127 and b"no-such-command" in missing.output


def test_exec_runs_in_the_ranks_sandbox_as_the_ranks_uid(stack: Stack, alice: str, job: int) -> None:
    uid = _rank_uid(stack, job)
    assert uid != 0
    assert _exec(stack, alice, job, "id -u").output.decode().strip() == str(uid)
    ps = _exec(stack, alice, job, "ps -eo user:20,pid,args").output.decode()
    assert "serve_tcp.py" in ps, ps  # it sees the rank's processes (py-spy would)
    assert "service.cli.main" not in ps and "bwrap" not in ps, ps  # and nothing of the host's
    status = _exec(stack, alice, job, "cat /proc/self/status").output.decode()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    assert _exec(stack, alice, job, "pwd").output == b"/job\n"
    # the walls of contract §7 hold: no TORCHJOBS_HOME, no new namespace, the worker's secret nowhere
    assert (stack.home / "torchjobs.db").exists()
    assert _exec(stack, alice, job, f"test -e {stack.home}/torchjobs.db").exit_code == 1
    assert _exec(stack, alice, job, "unshare -U true").exit_code != 0
    env = _exec(stack, alice, job, "env").output.decode()
    assert "TORCHJOBS_JOB_ID=" in env and "TORCHJOBS_HOME" not in env and ADMIN_TOKEN not in env
    assert _endpoint(stack)[1] not in env


def test_the_snoop_of_contract_7_finds_nothing_through_exec(stack: Stack, alice: str, job: int) -> None:
    """tests/scripts/snoop.py, the hostile job of test_sandbox.py, run by exec in alice's rank."""
    targets = ":".join(
        str(stack.home / p) for p in ("", "admin.token", "torchjobs.db", "runs", "checkpoints")
    )
    victims = ",".join(str(p.pid) for p in stack.procs.values())
    snoop = f"env SNOOP_WALK=1 SNOOP_TARGETS={targets} SNOOP_PIDS={victims} {sys.executable} -I {SNOOP}"
    done = _exec(stack, alice, job, snoop)
    log = done.output.decode(errors="replace")
    assert "SNOOP DONE" in log, log[-3000:]
    assert log.count("FILE ") > 10, "the snoop read almost nothing: is it blind?"
    assert ADMIN_TOKEN not in log and _endpoint(stack)[1] not in log
    assert "KILLED" not in log and "TRACED" not in log and "WROTE" not in log, log[-3000:]
    assert "CGROUP " not in log, "it listed the host's control groups (other job nodes' among them)"
    assert all(p.poll() is None for p in stack.procs.values())  # the service lives on


def test_a_pty_session_and_its_resize(stack: Stack, alice: str, job: int) -> None:
    with _session(stack, alice, job, cmd="sh", tty="true") as ws:
        ws.send(json.dumps({"resize": [33, 101]}))
        ws.send(b"tty; stty size; exit 5\n")
        output, code = _drain(ws)
    assert code == 5
    assert b"/dev/pts/" in output and b"33 101" in output, output


def _drain(ws: ClientConnection) -> tuple[bytes, int | None]:
    output, code = b"", None
    try:
        for message in ws:
            if isinstance(message, bytes):
                output += message
            else:
                code = json.loads(message)["exit_code"]
    except ConnectionClosed:
        pass
    return output, code


def test_refusals_are_http_answers(stack: Stack, alice: str, job: int) -> None:
    _, bob = _user(stack, "bob")
    assert _refusal(stack, bob, job, cmd="true")[0] == 404
    assert _refusal(stack, bob, job, port=PORT)[0] == 404
    assert _refusal(stack, None, job, cmd="true")[0] == 401
    assert _refusal(stack, "not-a-token", job, cmd="true")[0] == 401
    assert _refusal(stack, alice, 10**9, cmd="true")[0] == 404
    for params in ({"cmd": ""}, {"cmd": "'open"}, {"cmd": "true", "node_rank": 1},
                   {"cmd": "true", "local_rank": 1}, {"cmd": "true", "node_rank": "x"},
                   {"cmd": "true", "tty": "maybe"}, {"port": 0}, {"port": 1}):  # fmt: skip
        status, detail = _refusal(stack, alice, job, **params)
        assert status == 400, (params, status, detail)


def test_each_session_is_an_event(stack: Stack, alice: str, job: int) -> None:
    _exec(stack, alice, job, "echo recorded")
    events = [e for e in stack.events(job) if e["type"] == "exec"]
    assert {"user": "alice", "node_rank": 0, "local_rank": 0, "cmd": "echo recorded"} in [
        e["data"] for e in events
    ]


def test_the_workers_endpoint_says_nothing_without_the_secret(stack: Stack) -> None:
    address, secret = _endpoint(stack)
    host, _, port = address.rpartition(":")
    request = {"op": "exec", "job_id": 1, "attempt": 1, "node_rank": 0, "local_rank": 0, "argv": ["id"]}
    for wrong in ("0" * 64, secret[:-1] + ("0" if secret[-1] != "0" else "1")):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            greeting = sock.makefile("rb").readline()
            assert greeting.startswith(exec_link.GREETING)
            nonce = greeting[len(exec_link.GREETING) : -1].decode()
            sock.sendall(exec_link.signed_line(wrong, nonce, request))
            assert sock.recv(100) == b""  # hung up on, not a word


def _endpoint(stack: Stack) -> tuple[str, str]:
    with sqlite3.connect(stack.home / "torchjobs.db") as db:
        row = db.execute("SELECT exec_address, exec_secret FROM workers WHERE name = 'local'").fetchone()
    assert row and row[0] and row[1], row
    return str(row[0]), str(row[1])


def test_forward_through_the_cli(stack: Stack, alice: str, job: int) -> None:
    env = {**stack.env, "TORCHJOBS_URL": stack.url, "TORCHJOBS_TOKEN": alice}
    cli = subprocess.Popen(
        harness.torchjobs_cmd("forward", str(job), f"0:{PORT}"), env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert cli.stdout is not None
        line = cli.stdout.readline()
        local = int(line.split("127.0.0.1:")[1].split()[0])
        for word in (b"one", b"two"):
            with socket.create_connection(("127.0.0.1", local), timeout=30) as sock:
                stream = sock.makefile("rb")
                assert stream.readline() == b"ready\n"  # what the service says first comes through
                sock.sendall(word + b"\n")
                assert stream.readline() == b"echo:" + word + b"\n"
    finally:
        cli.terminate()
        cli.wait(timeout=30)


def test_the_cli_passes_the_exit_code_and_stdin(stack: Stack, alice: str, job: int) -> None:
    env = {**stack.env, "TORCHJOBS_URL": stack.url, "TORCHJOBS_TOKEN": alice}
    done = subprocess.run(
        harness.torchjobs_cmd("exec", str(job), "--", "sh", "-c", "cat; exit 4"),
        env=env, input=b"through\n", capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert done.stdout == b"through\n"


def test_the_job_cannot_catch_an_exec_before_its_seccomp_filter(stack: Stack, alice: str, job: int) -> None:
    """The filter is on before the exec'd process is the job's uid: a process of the job that
    attaches to it with ptrace at the first moment it can finds it filtered (it was unfiltered
    for its Python's start-up, long enough to be made to exec a shell without the filter)."""
    no_exec_is_caught_unfiltered(stack, alice, job)


def no_exec_is_caught_unfiltered(stack: Stack, token: str, job: int) -> None:
    """A watcher of the job's (tests/scripts/exec_watcher.py) seizes every new process of the
    job's PID namespace as soon as it can, while execs come and go: every one it caught was
    filtered already (also used by tests/integration/test_non_root.py)."""
    watcher = f"{sys.executable} {harness.SCRIPTS / 'exec_watcher.py'} 30"
    seen: dict[str, ExecResult] = {}
    thread = threading.Thread(target=lambda: seen.update(w=_exec(stack, token, job, watcher)), daemon=True)
    thread.start()
    harness.wait_for(lambda: _mentions(stack, job, b"exec_watcher.py"), 30, "the watcher")
    for _ in range(20):
        assert _exec(stack, token, job, "true").exit_code == 0
        if not thread.is_alive():
            break
    thread.join(timeout=60)
    said = seen["w"].output.decode()
    assert "seized seccomp" in said, said  # it did catch one: the test is not vacuous
    assert "seized seccomp 2" in said and "seized seccomp 0" not in said, said


def test_a_session_id_reused_on_the_host_is_not_the_execs(stack: Stack, alice: str, job: int) -> None:
    """An exec's daemon made a session of its own and ended; a root process of the host then
    got that number as its PID and session id. When the client goes, the worker kills what is
    left of the exec's sessions: never that host process."""
    rank_uid = _rank_uid(stack, job)
    with _session(stack, alice, job, cmd="sh -c 'setsid sleep 3; exec sleep 600'") as ws:
        host_pid = harness.wait_for(lambda: _host_pid(b"sleep\x003\x00", rank_uid), 30, "the daemon")
        harness.wait_for(lambda: not Path(f"/proc/{host_pid}").exists(), 30, "the daemon to end")
        victim = _process_with_pid(host_pid)
        ws.close()
    try:
        harness.wait_for(lambda: _count(stack, job, b"sleep\x00600") == 0, 30, "the session's processes")
        assert victim.poll() is None, "the worker killed a host process through a stale session id"
    finally:
        victim.kill()
        victim.wait()


def _host_pid(cmdline: bytes, uid: int) -> int | None:
    for entry in os.listdir("/proc"):
        try:
            ours = entry.isdigit() and Path(f"/proc/{entry}").stat().st_uid == uid
            if ours and Path(f"/proc/{entry}/cmdline").read_bytes() == cmdline:
                return int(entry)
        except OSError:
            continue
    return None


def _process_with_pid(pid: int) -> subprocess.Popen[bytes]:
    """A root process of the host that leads a session numbered `pid` (the kernel hands out the
    PID after ns_last_pid; another process may take it first: tried again)."""
    for _ in range(200):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(["setsid", "sleep", "600"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError(f"could not start a host process as PID {pid}")


def test_a_command_that_reads_no_stdin_ends_when_the_client_goes(stack: Stack, alice: str, job: int) -> None:
    """12 MB of stdin to `sleep`, which reads none, then the client drops the connection: the
    worker's session ends with it (it blocked in the write, and kept the process, a thread and
    the socket until the job ended). 12 MB is more than the loopback's socket buffers hold
    between the API and the worker: the API's close then cannot wait for what it had in flight
    to go (3 MB fitted, mostly: CI saw the session outlive the client once)."""
    ws = _session(stack, alice, job, cmd="sleep 301")
    harness.wait_for(lambda: _count(stack, job, b"sleep\x00301") == 1, 30, "the command")
    ws.send(b"x" * 12_000_000)
    ws.socket.close()
    harness.wait_for(lambda: _count(stack, job, b"sleep\x00301") == 0, 60, "the command to be killed")


def test_the_per_user_limit(stack: Stack, alice: str, job: int) -> None:
    with contextlib.ExitStack() as sessions:
        for _ in range(MAX_PER_USER):
            sessions.enter_context(_session(stack, alice, job, cmd="cat"))
        assert _refusal(stack, alice, job, cmd="true")[0] == 429
        harness.wait_for(lambda: _count(stack, job, b"cat") == MAX_PER_USER, 30, "the sessions' processes")
    # the client went: the worker killed what its sessions ran
    harness.wait_for(lambda: _count(stack, job, b"cat") == 0, 30, "the sessions' processes to go")
    harness.wait_for(lambda: _exec(stack, alice, job, "true").exit_code == 0, 30, "a slot again")


CONCURRENT = 50


def test_fifty_concurrent_execs_against_the_per_user_limit(stack: Stack, alice: str, job: int) -> None:
    """All at once: exactly the limit's worth open, every other one a 429, none a 5xx; and
    every slot back once the clients go."""
    barrier, answered, done = threading.Barrier(CONCURRENT), threading.Semaphore(0), threading.Event()

    def attempt() -> int:
        barrier.wait()
        try:
            with _session(stack, alice, job, cmd="cat"):
                answered.release()
                done.wait(120)  # held open until every attempt has its answer
                return 101
        except InvalidStatus as exc:
            answered.release()
            return exc.response.status_code

    with ThreadPoolExecutor(CONCURRENT) as pool:
        futures = [pool.submit(attempt) for _ in range(CONCURRENT)]
        for _ in range(CONCURRENT):
            assert answered.acquire(timeout=120), "an exec was never answered"
        done.set()
        codes = sorted(f.result() for f in futures)
    assert codes == [101] * MAX_PER_USER + [429] * (CONCURRENT - MAX_PER_USER), codes
    harness.wait_for(lambda: _count(stack, job, b"cat") == 0, 30, "the sessions' processes to go")
    harness.wait_for(lambda: _exec(stack, alice, job, "true").exit_code == 0, 30, "a slot again")


def test_py_spy_dumps_the_rank_from_inside_its_sandbox(stack: Stack, alice: str, job: int) -> None:
    """The debugging exec is for: py-spy, as the rank's uid in the rank's namespaces, reads the
    rank's Python stack (ptrace of one's own processes stays allowed by the seccomp filter)."""
    spy = Path(sys.executable).with_name("py-spy")
    assert spy.exists(), "py-spy is a dev dependency (pyproject.toml)"
    found = _exec(stack, alice, job, "pgrep -f serve_tcp.py")
    assert found.exit_code == 0, found.output
    pid = found.output.split()[0].decode()
    dump = _exec(stack, alice, job, f"{spy} dump --pid {pid}")
    assert dump.exit_code == 0, dump.output.decode(errors="replace")
    assert b"serve_tcp.py" in dump.output and b"Thread" in dump.output, dump.output


def test_forward_to_an_http_server_the_job_started(stack: Stack, alice: str) -> None:
    """A second job of alice's runs Python's http.server on its own loopback; `torchjobs forward`
    brings it to a local port, where plain HTTP GETs reach it (the server's own answer)."""
    job_id = int(stack.submit(harness.script_job("serve_http.py", str(HTTP_PORT)), alice)["id"])
    try:
        stack.wait_job(job_id, timeout=180, states=("running",))
        env = {**stack.env, "TORCHJOBS_URL": stack.url, "TORCHJOBS_TOKEN": alice}
        cli = subprocess.Popen(
            harness.torchjobs_cmd("forward", str(job_id), f"0:{HTTP_PORT}"),
            env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert cli.stdout is not None
            local = int(cli.stdout.readline().split("127.0.0.1:")[1].split()[0])
            url = f"http://127.0.0.1:{local}/hello.txt"
            answer = harness.wait_for(lambda: _get_when_up(url), 60, "the job's http.server")
            assert answer.status_code == 200 and answer.text == f"served by job {job_id}\n"
            assert "SimpleHTTP" in answer.headers["server"]
            assert httpx.get(f"http://127.0.0.1:{local}/missing", timeout=30).status_code == 404
        finally:
            cli.terminate()
            cli.wait(timeout=30)
    finally:
        with stack.client() as c:
            c.post(f"/v1/jobs/{job_id}/cancel")
        stack.wait_job(job_id, timeout=120)


def _get_when_up(url: str) -> httpx.Response | None:
    """The job's server may not listen yet: the forward then closes the connection at once."""
    try:
        return harness.local_get(url, timeout=30)
    except httpx.TransportError:
        return None


def test_the_cli_shell_is_a_real_pty(stack: Stack, alice: str, job: int) -> None:
    """`torchjobs shell` on a terminal of its own (a pty this test holds): the remote pty gets
    this terminal's size at the start and again on SIGWINCH; Ctrl-C interrupts the remote
    command, not the CLI (the local terminal is raw); the shell's exit code is the CLI's."""
    env = {**stack.env, "TORCHJOBS_URL": stack.url, "TORCHJOBS_TOKEN": alice}
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    cli = subprocess.Popen(
        harness.torchjobs_cmd("shell", str(job), "--cmd", "sh -i"),
        env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    seen = bytearray()
    try:
        _read_until(master, seen, b"$ ")  # the prompt: a shell may drop what was typed before
        os.write(master, b"stty size\n")
        _read_until(master, seen, b"40 120")
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 91, 0, 0))
        for _ in range(200):  # what the kernel sends a terminal's foreground; a burst, as when
            cli.send_signal(signal.SIGWINCH)  # a window is dragged: the CLI must not hang in it
        os.write(master, b"stty size\n")
        _read_until(master, seen, b"33 91")
        os.write(master, b"sleep 300\n")
        harness.wait_for(lambda: _count(stack, job, b"sleep") == 1, 30, "the remote sleep")
        os.write(master, b"\x03")
        harness.wait_for(lambda: _count(stack, job, b"sleep") == 0, 30, "Ctrl-C to end it")
        os.write(master, b"echo status-$?\n")
        _read_until(master, seen, b"status-130")  # SIGINT ended the sleep, over there
        assert cli.poll() is None  # and the CLI lives on
        os.write(master, b"exit 9\n")
        assert cli.wait(timeout=60) == 9
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        os.close(master)


def _read_until(fd: int, seen: bytearray, needle: bytes, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} never came: {bytes(seen[-2000:])!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the CLI ended: its side of the pty is closed
                break
    assert needle in seen, bytes(seen[-2000:])


def test_a_revoked_token_closes_an_open_shell(stack: Stack, job: int) -> None:
    with stack.client() as c:
        owner = c.get(f"/v1/jobs/{job}").json()["owner"]
        users = {u["name"]: u["id"] for u in c.get("/v1/users").json()["items"]}
        token = c.post(f"/v1/users/{users[owner]}/tokens").json()["token"]  # alice's, anew
    with _session(stack, token, job, cmd="sh", tty="true") as ws:
        ws.send(b"echo open\n")
        with stack.client() as c:
            assert c.delete(f"/v1/users/{users[owner]}/tokens").status_code == 204
        _output, code = _drain(ws)  # closed within TORCHJOBS_STREAM_RECHECK_S, no exit code
    assert code is None


def test_the_session_ends_with_the_job_and_leaves_nothing(stack: Stack, job: int) -> None:
    """Runs last: it revokes nothing but ends the job (alice's old token is gone: the admin acts)."""
    result: dict[str, Any] = {}
    stubborn = 'sh -c \'trap "" TERM; (trap "" TERM; sleep 1000 &) ; sleep 1000\''

    def hold() -> None:
        with _session(stack, ADMIN_TOKEN, job, cmd=stubborn) as ws:
            result["drained"] = _drain(ws)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    harness.wait_for(lambda: _count(stack, job, b"sleep") >= 2, 30, "the stubborn processes")
    with stack.client() as c:
        assert c.post(f"/v1/jobs/{job}/cancel").status_code in (200, 202)
    stack.wait_job(job, timeout=120)
    holder.join(timeout=60)
    assert not holder.is_alive(), "the session outlived its job"
    assert _refusal(stack, ADMIN_TOKEN, job, cmd="true")[0] == 400
    harness.wait_for(lambda: not harness.pids_of_job(job, stack.home), 30, "nothing of the job left")
    assert _count(stack, job, b"sleep") == 0


def _mentions(stack: Stack, job_id: int, needle: bytes) -> bool:
    for pid in harness.pids_of_job(job_id, stack.home):
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
    return False


def _count(stack: Stack, job_id: int, program: bytes) -> int:
    """The job's processes running `program`."""
    found = 0
    for pid in harness.pids_of_job(job_id, stack.home):
        try:
            found += Path(f"/proc/{pid}/cmdline").read_bytes().startswith(program + b"\0")
        except OSError:
            continue
    return found


def test_the_same_door_between_separate_processes_over_postgresql(production: Stack) -> None:
    """`torchjobs server` and `torchjobs worker` as separate processes with PostgreSQL and Redis
    between them: the API finds the worker's endpoint through the database alone."""
    job_id = _running_job(production, ADMIN_TOKEN)
    done = _exec(production, ADMIN_TOKEN, job_id, "sh -c 'echo $TORCHJOBS_JOB_ID; exit 7'")
    assert done == ExecResult(f"{job_id}\n".encode(), 7)
    with production.client() as c:
        c.post(f"/v1/jobs/{job_id}/cancel")
    production.wait_job(job_id, timeout=120)
