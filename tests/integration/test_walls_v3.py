"""The walls have no doors (contract §7 v3): a job attacking the worker through its own run
folder, as an ordinary user, on a real sandboxed worker (`torchjobs up` as root here).

Each attack is one run of tests/scripts/break_out.py; it is what made the worker hand out the
admin token, upload it as a checkpoint, delete a host folder and hang before the fix. After each
job: nothing of it runs on the host, and nothing it wrote is left there.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.testing import harness
from service.testing.harness import ADMIN_TOKEN, Stack
from workers.launcher import cgroups
from workers.launcher.command import NodePaths
from workers.launcher.run_dir import tmp_root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the root worker's sandbox (bwrap-setuid)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = Path(tmp_path_factory.mktemp("walls-v3"))
    limits = {
        "TORCHJOBS_JOB_PIDS_MAX": "200",
        "TORCHJOBS_MEMORY_PER_GPU_MB": "900",
        "TORCHJOBS_JOB_DISK_MAX_MB": "100",
    }
    stack = harness.embedded_stack(home, harness.make_env(home, **limits))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def mallory(stack: Stack) -> str:
    with stack.client() as c:
        resp = c.post("/v1/users", json={"name": "mallory"})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["token"])


def _attack(stack: Stack, token: str, attack: str, target: Path | str, **spec: object) -> dict:
    entry = {"kind": "script", "path": "break_out.py"}
    job = stack.submit(
        {
            "mode": "single",
            "entrypoint": entry,
            "env": {"BREAK": attack, "BREAK_TARGET": str(target)},
            **spec,
        },
        token,
    )
    done = stack.wait_job(job["id"], timeout=180)
    _nothing_left(stack, done["id"])
    return done


def _nothing_left(stack: Stack, job_id: int) -> None:
    """No process of the job, no run folder, no TMPDIR: the job ends whole (contract §7 v3)."""
    assert harness.wait_for(
        lambda: not harness.pids_of_job(job_id, stack.home), 30, "the job's processes gone"
    )
    runs = harness.job_run_dirs(stack.home, job_id)
    # the worker removes the run folder after it has reported the end: soon, not at once
    harness.wait_for(lambda: not [p for p in runs if p.is_dir()], 60, f"the run folders to go: {runs}")
    for run_dir in runs:
        assert not NodePaths(run_dir=run_dir, tmp_root=tmp_root()).tmp.exists()


def _logs(stack: Stack, token: str, job_id: int) -> str:
    with stack.client(token) as c:
        return c.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0}).text


def test_log_links_to_the_admin_token_and_the_workers_environment_read_nothing(
    stack: Stack, mallory: str
) -> None:
    done = _attack(stack, mallory, "logs", stack.home / "admin.token")
    assert done["state"] == "failed"
    seen = _logs(stack, mallory, done["id"]) + (done["error"] or "")
    assert ADMIN_TOKEN not in seen, "the job's log or error carried the admin token"
    assert "TORCHJOBS_HOME=" not in seen and "TORCHJOBS_ADMIN_TOKEN" not in seen, "the worker's environment"
    assert "before the swap" in seen or "not read" in seen  # the log was read, as data


def test_a_tmp_link_to_a_host_folder_deletes_nothing(stack: Stack, mallory: str, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.mkdir(mode=0o700)
    (canary / "keep").write_text("root's")
    done = _attack(stack, mallory, "tmp", canary)
    assert done["state"] == "succeeded", done["error"]
    assert (canary / "keep").read_text() == "root's"


def test_checkpoints_raced_with_links_store_only_the_jobs_own_bytes(stack: Stack, mallory: str) -> None:
    done = _attack(stack, mallory, "checkpoints", stack.home / "admin.token")
    assert done["state"] == "succeeded", done["error"]
    with stack.client(mallory) as c:
        items = c.get(f"/v1/jobs/{done['id']}/checkpoints").json()["items"]
        bodies = {i["name"]: c.get(f"/v1/checkpoints/{i['id']}/download").content for i in items}
    assert bodies, "no checkpoint was stored at all"
    for name, body in bodies.items():
        assert ADMIN_TOKEN.encode() not in body, f"{name} was the admin token"
        assert body.startswith(b"real checkpoint"), (name, body[:60])


def test_fifos_for_logs_and_events_do_not_hold_the_job_past_its_time_limit(
    stack: Stack, mallory: str
) -> None:
    done = _attack(stack, mallory, "fifo", Path("/nonexistent"), max_duration_s=15)
    assert done["state"] == "failed"
    assert done["error"].startswith("time limit"), done["error"]


@pytest.mark.skipif(cgroups.detect("probe", Path("/nonexistent")) is None, reason="no writable cgroups here")
@pytest.mark.parametrize(("attack", "limit"), [("pids", "process limit"), ("memory", "memory limit")])
def test_a_job_past_its_limits_fails_naming_the_limit(
    stack: Stack, mallory: str, attack: str, limit: str
) -> None:
    done = _attack(stack, mallory, attack, Path("/nonexistent"))
    assert done["state"] == "failed"
    assert done["error"].startswith(limit), done["error"]
    assert done["attempt"] == 1  # the job's own doing: not retried


def test_no_kernel_keys_user_namespaces_or_mounts_from_a_job(stack: Stack, mallory: str) -> None:
    """A key left in the user keyring would be the next job's of that uid to read; a user
    namespace or a mount is a way around the walls: the sandbox's seccomp filter refuses all."""
    done = _attack(stack, mallory, "kernel", Path("/nonexistent"))
    assert done["state"] == "succeeded", done["error"]
    line = next(x for x in _logs(stack, mallory, done["id"]).splitlines() if x.startswith("KERNEL "))
    found = json.loads(line.removeprefix("KERNEL "))
    assert found["add_key"] == errno.EPERM and found["mount"] == errno.EPERM
    assert found["unshare -Ur"] != 0


def _host_address() -> str:
    """This host's own address on its network (not loopback), as another machine reaches it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
        return str(probe.getsockname()[0])


def test_a_job_reaches_no_host_service(stack: Stack, mallory: str) -> None:
    """The host's PostgreSQL (trust auth: a superuser to whoever connects) and Redis on its
    loopback, and a port listening on every address of the host: none answers a job."""
    with socket.create_server(("0.0.0.0", 0)) as listener:
        port = listener.getsockname()[1]
        targets = [f"127.0.0.1:{p}" for p in (5432, 6379, port)] + [f"{_host_address()}:{port}"]
        for target in targets:  # each answers the host itself: the job's failure is the wall
            host, p = target.rsplit(":", 1)
            socket.create_connection((host, int(p)), timeout=3).close()
        done = _attack(stack, mallory, "network", ",".join(targets))
    assert done["state"] == "succeeded", done["error"]
    line = next(x for x in _logs(stack, mallory, done["id"]).splitlines() if x.startswith("NETWORK "))
    found = json.loads(line.removeprefix("NETWORK "))
    assert set(found) == set(targets)
    reached = [t for t, how in found.items() if how == "connected"]
    assert not reached, f"a job reached {reached}"


def test_each_job_runs_as_a_uid_of_its_own_never_reused(stack: Stack, mallory: str) -> None:
    with stack.client() as c:
        other = c.post("/v1/users", json={"name": "trudy"}).json()["token"]
    seen = []
    for token in (mallory, other, mallory):
        done = _attack(stack, token, "uid", "")
        assert done["state"] == "succeeded", done["error"]
        line = next(x for x in _logs(stack, token, done["id"]).splitlines() if x.startswith("UID "))
        uid, gid, name = line.split()[1:]
        assert uid == gid and 2_000_000_000 <= int(uid) <= 2_099_999_999, line
        assert name == "torchjobs"  # the sandbox's /etc/passwd names it: getpass, torch's caches
        seen.append(uid)
    assert len(set(seen)) == 3, seen


def test_a_job_past_its_disk_limit_fails_naming_it(stack: Stack, mallory: str) -> None:
    done = _attack(stack, mallory, "disk", "")
    assert done["state"] == "failed"
    assert done["error"].startswith("disk limit"), done["error"]
    assert done["attempt"] == 1
