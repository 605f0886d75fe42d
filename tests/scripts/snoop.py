"""A hostile job: prints whatever it can read of the machine, and tries to reach other processes.

Used by tests/integration/test_sandbox.py as a script, from a factory and through the
PYTHONWARNINGS/BROWSER trick on a builtin job. Driven by environment variables of the job:

- SNOOP_TARGETS: ':'-separated paths to try to read besides the walk (the worker's home, the
  database file, the token file, the storage root, another job's folder)
- SNOOP_WALK=1: also walk the filesystem from / (not /proc, /sys, /dev, /usr or the Python
  installation), reading every file it can
- SNOOP_PIDS: ','-separated host pids to signal (SIGKILL) and ptrace
- SNOOP_OUT: a file to print to instead of stdout (the BROWSER trick's process has no say)

For each file it can read it prints `FILE path sha256 first-bytes`; every /proc/*/environ and
cmdline, every control group it can list (`CGROUP path`), and its own environment. It ends
with `SNOOP DONE`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import sys

SKIP = ("/proc", "/sys", "/dev", "/usr", sys.prefix, sys.base_prefix)
MAX_FILES = 20_000


def show_file(path: str, out) -> None:
    try:
        with open(path, "rb") as fh:
            data = fh.read(64 * 1024 * 1024)
    except OSError:
        return
    print(f"FILE {path} {hashlib.sha256(data).hexdigest()} {data[:256]!r}", file=out)


def walk(top: str, out, budget: list[int]) -> None:
    if os.path.isfile(top):
        show_file(top, out)
        return
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if not os.path.join(root, d).startswith(SKIP)]
        for name in files:
            if budget[0] <= 0:
                return
            budget[0] -= 1
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                show_file(path, out)


def procs(out) -> None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            for what in ("environ", "cmdline"):
                try:
                    with open(f"/proc/{entry}/{what}", "rb") as fh:
                        print(f"PROC {entry} {what} {fh.read()!r}", file=out)
                except OSError:
                    pass


def cgroups(out) -> None:
    """The control groups it can list: on the host, every job node's (`job-ID-ATTEMPT-NODE`)
    with its memory and process counts, and the host services'."""
    seen = 0
    for root, dirs, _files in os.walk("/sys/fs/cgroup"):
        for name in dirs:
            seen += 1
            if seen <= 2000:
                print(f"CGROUP {os.path.join(root, name)}", file=out)


def attack(pids: list[int], out) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for pid in pids:
        if os.path.exists(f"/proc/{pid}"):
            print(f"ATTACK {pid}: that number is one of our own processes here, not the target", file=out)
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed = "KILLED"
        except OSError as exc:
            killed = f"kill refused ({exc.__class__.__name__})"
        traced = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
        trace = "TRACED" if traced == 0 else f"ptrace refused (errno {ctypes.get_errno()})"
        print(f"ATTACK {pid}: {killed}; {trace}", file=out)


def try_writes(out) -> None:
    for path in (os.path.join(sys.prefix, "snoop-was-here"), "/usr/snoop-was-here"):
        try:
            with open(path, "w") as fh:
                fh.write("x")
            print(f"WROTE {path}", file=out)
        except OSError as exc:
            print(f"write refused {path} ({exc.__class__.__name__})", file=out)


def snoop() -> None:
    out_path = os.environ.get("SNOOP_OUT")
    out = open(out_path, "a") if out_path else sys.stdout  # noqa: SIM115
    warm = "workers.runtime.warm_rank" in sys.modules  # forked from a rank server (issue #42)
    print(f"SNOOP uid={os.getuid()} pid={os.getpid()} warm={warm}", file=out)
    print(f"MYENV {dict(os.environ)!r}", file=out)
    procs(out)
    cgroups(out)
    budget = [MAX_FILES]
    for target in filter(None, os.environ.get("SNOOP_TARGETS", "").split(":")):
        walk(target, out, budget)
    if os.environ.get("SNOOP_WALK") == "1":
        walk("/", out, budget)
    attack([int(p) for p in filter(None, os.environ.get("SNOOP_PIDS", "").split(","))], out)
    try_writes(out)
    print("SNOOP DONE", file=out, flush=True)


if __name__ == "__main__":
    snoop()
