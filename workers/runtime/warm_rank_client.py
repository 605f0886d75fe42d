"""A rank's first process when its node took a warm spare: asks the spare's rank server
(warm_rank_server.py) to fork the rank from a process that has already imported torch, and
stands in for it towards torchrun.

torchrun starts `python -I -S warm_rank_client.py SOCKET -- ARGV...` instead of
`python ARGV...`: a bare interpreter (no site, about 20 ms) that imports only the standard
library. It sends the server its argv, environment, folder and descriptors 0-2, then mirrors
the rank: the signals torchrun sends it go to the rank's process group, and it exits as the
rank exits (the same code, or the same signal), so torchrun's supervision, logs and teardown
see what they would see of a cold rank. Where there is no server, or it declines (a job whose
own packages could be shadowed by what the server imported, an environment too large to show),
it execs the cold rank itself: the fallback is always the launch as it was.

A fourth descriptor, the read end of a pipe only this process holds open for writing, goes to
the rank: if this process dies (torchrun's SIGKILL at the end of its grace), the rank sees the
pipe's end and kills its group, as torchrun's killpg would have killed a cold rank. If torchrun
itself dies, this process asks the rank to stop as the runtime's ParentWatchdog would (SIGTERM),
then kills it after the same grace.
"""

import contextlib
import json
import os
import select
import signal
import socket
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
ORPHAN_GRACE_S = 30.0  # the runtime's ParentWatchdog's
ENV_BLANK = b"TORCHJOBS_WARM_CLIENT=1"


def main() -> int:
    split = sys.argv.index("--")
    path, argv = sys.argv[1], sys.argv[split + 1 :]
    env = dict(os.environ)
    rank = ask_for_rank(path, argv, env)
    if rank is None:
        os.execve(sys.executable, [sys.executable, *argv], env)  # cold, as the launch was
    lines, pid, life = rank
    hide_environment()
    return mirror(lines, pid, life)


class Lines:
    """Lines from the server, read with recv (a file object cannot survive a timeout)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def next(self, timeout_s: float | None = None) -> list[bytes] | None:
        """The next line's words; None when nothing came within `timeout_s`; [] at the end."""
        while b"\n" not in self.buffer:
            if timeout_s is not None and not select.select([self.conn], [], [], timeout_s)[0]:
                return None
            try:
                chunk = self.conn.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                return []
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.split()


def ask_for_rank(path: str, argv: list[str], env: dict[str, str]) -> tuple[Lines, int, int] | None:
    """The forked rank's pid, or None where the server is not there or declines."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except OSError:
        return None
    read_end, write_end = os.pipe()
    with open("/proc/self/environ", "rb") as fh:  # as exec gave it, before Python's own changes
        shown = fh.read().decode("utf-8", "surrogateescape")
    request = json.dumps({"argv": argv, "env": env, "shown": shown, "cwd": os.getcwd()}).encode()
    lines = Lines(conn)
    try:
        socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2, read_end])
        answer = lines.next() or []
    except OSError:
        answer = []
    os.close(read_end)
    if len(answer) != 2 or answer[0] != b"pid":
        conn.close()
        os.close(write_end)
        return None
    return lines, int(answer[1]), write_end


def hide_environment() -> None:
    """Blank this process's environment in /proc: the worker finds a rank by LOCAL_RANK there
    (stall stacks, exec), and the rank is the forked process now, not this one."""
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end (proc(5): 50 and 51)
    if end - start >= len(ENV_BLANK):
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(ENV_BLANK.ljust(end - start, b"\0"))


def mirror(lines: Lines, pid: int, life: int) -> int:
    """Forward torchrun's signals to the rank's group and exit as the rank exits. `life` stays
    open for as long as this process lives."""
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: _signal_group(pid, s))
    parent = os.getppid()
    orphaned_at: float | None = None
    while (words := lines.next(timeout_s=1.0)) is None:
        if orphaned_at is None and os.getppid() != parent:
            orphaned_at = time.monotonic()
            _signal_group(pid, signal.SIGTERM)
        elif orphaned_at is not None and time.monotonic() - orphaned_at > ORPHAN_GRACE_S:
            _signal_group(pid, signal.SIGKILL)
    if len(words) != 2 or words[0] != b"exit":  # the server went away: the rank cannot be watched
        _signal_group(pid, signal.SIGKILL)
        return 1
    return _exit_as(int(words[1]))


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, sig)


def _exit_as(status: int) -> int:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
