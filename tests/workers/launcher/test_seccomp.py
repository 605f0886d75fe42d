"""The sandbox's system-call filter (contract §7 v3), installed by the sandbox's real first
program (`sandbox.ENTRY`) on this machine's kernel: what it refuses, and what PyTorch needs
(forks, threads, a DataLoader's workers, gloo's collectives) still works under it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers.launcher import lifeline, sandbox, seccomp

REFUSED = textwrap.dedent(
    """
    import ctypes, json, os, subprocess
    libc = ctypes.CDLL(None, use_errno=True)
    N = json.loads(os.environ["NR"])
    def call(name, *args):
        ctypes.set_errno(0)
        rc = libc.syscall(N[name], *args)
        return rc, ctypes.get_errno()
    out = {
        "add_key": call("add_key", b"user", b"k", b"secret", 6, ctypes.c_long(-3)),
        "keyctl": call("keyctl", 0, ctypes.c_long(-3), 0),
        "unshare": call("unshare", 0x10000000),
        "setns": call("setns", 0, 0),
        "mount": call("mount", b"none", b"/tmp", b"tmpfs", 0, 0),
        "bpf": call("bpf", 0, 0, 0),
        "perf_event_open": call("perf_event_open", 0, 0, -1, -1, 0),
        "clone3": call("clone3", 0, 0),
    }
    out["unshare -Ur"] = subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode
    print(json.dumps(out))
    """
)

STILL_WORKS = textwrap.dedent(
    """
    import os, subprocess, threading
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    t = threading.Thread(target=lambda: None); t.start(); t.join()
    assert subprocess.run(["true"]).returncode == 0
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, num_workers=2)
    assert sum(float(b[0].sum()) for b in loader) == 28.0
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.ones(3); dist.all_reduce(x); dist.destroy_process_group()
    print("works", x.tolist())
    """
)


def _under_filter(tmp_path: Path, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`code` run by the sandbox's own first program, filter and all (no bwrap: the filter is
    what is tested here; tests/integration/test_walls_v3.py runs it in the real sandbox)."""
    env_file = tmp_path / "env.json"
    env_file.write_text(json.dumps({"PATH": "/usr/bin:/bin", **env}))
    life = [str(lifeline.read_end()), str(lifeline.ORPHAN_GRACE_S)]
    argv = [sys.executable, "-S", "-I", "-c", sandbox.ENTRY, *life, seccomp.program().hex(), str(env_file)]
    argv += [sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, pass_fds=lifeline.pass_fds())


@pytest.fixture
def machine() -> str:
    import platform

    if platform.machine() not in seccomp.SYSCALLS:
        pytest.skip(f"no syscall table for {platform.machine()}")
    return platform.machine()


def test_what_the_filter_refuses(tmp_path: Path, machine: str) -> None:
    done = _under_filter(tmp_path, REFUSED, {"NR": json.dumps(seccomp.SYSCALLS[machine])})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    for name in ("add_key", "keyctl", "unshare", "setns", "mount", "bpf", "perf_event_open"):
        assert out[name] == [-1, 1], (name, out[name])  # EPERM: no keyring, namespace, mount...
    assert out["clone3"] == [-1, 38]  # ENOSYS: the C library falls back to clone, which is checked
    assert out["unshare -Ur"] != 0


def test_pytorch_still_runs_under_it(tmp_path: Path, machine: str) -> None:
    from service.testing.harness import free_port

    done = _under_filter(tmp_path, STILL_WORKS, {"PORT": str(free_port()), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "works [1.0, 1.0, 1.0]" in done.stdout


def test_each_architecture_has_every_call_it_names() -> None:
    for machine, table in seccomp.SYSCALLS.items():
        assert "clone" in table and "clone3" in table
        prog = seccomp.program(machine)
        assert prog and len(prog) % 8 == 0 and len(prog) // 8 < 4096
    assert seccomp.program("sparc64") == b""
