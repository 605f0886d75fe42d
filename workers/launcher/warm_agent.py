"""`python -m workers.launcher.warm_agent`: a torchrun agent that has already imported torch.

Launching a node costs, before any rank exists, the agent's own interpreter start and its
import of torch (about 0.9 s here, more on a busy host). A worker keeps one such process
waiting (agents.py): it imports `torch.distributed.run` at once, then blocks on one line of
JSON on stdin — the launch's torchrun arguments, environment, working folder and agent log —
and from there is exactly `python -m torch.distributed.run ARGS` with that environment: the
same agent code, the ranks it starts are ordinary torchrun ranks with the launch's
environment. End of input (the worker went away before a job came) exits quietly.

Its first act, before it imports torch, is one line on stdout, `up`: in a spare sandbox it says
that bubblewrap has set the sandbox up around it (its binds read), so the worker may now move
the spare's folders under a node (agents.py waits for it; a spare taken before that once lost
its identity files to the move, and bubblewrap failed).

With `--warm-ranks` (a spare sandbox, `TORCHJOBS_WARM_RANKS`) it also forks a rank server off
itself, torch already imported (workers/runtime/warm_rank_server.py), and once the server
listens, the launch's ranks start through warm_rank_client.py, forked from the server: a rank
then skips its own import of torch and its first step's. The server's word on each rank (warm,
or cold and why) goes to this agent's log. The spare starts with room in its environment and
command line (sandbox_spares.py) that the server's forks show theirs in.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as the agent, not imported
    sys.stdout.write("up\n")
    sys.stdout.flush()

import torch.distributed.run as torchrun  # after `up`: the sandbox is set up by then

MARKER = "workers.launcher.warm_agent"  # procs.py recognises a warm agent by it
WARM_RANKS_FLAG = "--warm-ranks"
RANK_SOCKET = Path("/tmp/.torchjobs-warm-ranks/socket")  # the sandbox's own /tmp
CLIENT = str(Path(__file__).resolve().parent.parent / "runtime" / "warm_rank_client.py")


class RankServer:
    """The rank server forked off this agent (warm_rank_server.serve_forked)."""

    def __init__(self) -> None:
        from workers.runtime import warm_rank_server

        life_r, self.life = os.pipe()  # this process holds the write end: its end is the server's
        log_r, log_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.life)
            os.close(log_r)
            warm_rank_server.serve_forked(RANK_SOCKET, life_r, log_w)
        os.close(life_r)
        os.close(log_w)
        threading.Thread(target=_relay, args=(log_r,), name="torchjobs-warm-ranks-log", daemon=True).start()

    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False


def _relay(log: int) -> None:
    """The server's lines into this agent's stderr: its log, once the launch is adopted."""
    while chunk := os.read(log, 65536):
        try:
            os.write(2, chunk)
        except OSError:
            return


def through_warm_ranks(args: list[str], server: RankServer) -> list[str]:
    """torchrun's arguments with each rank started by the warm-rank client, when the server
    is alive and listening (else as they were: the ranks start cold)."""
    if not server.alive() or not RANK_SOCKET.is_socket() or "-m" not in args:
        print("torchjobs: ranks start cold (no warm rank server ready)", file=sys.stderr, flush=True)
        return args
    entry = args.index("-m")  # torchrun's own options are all --name=value (command.build_launch)
    client = ["--no-python", sys.executable, "-I", "-S", CLIENT, str(RANK_SOCKET), "--", "-u"]
    return [*args[:entry], *client, *args[entry:]]


def adopt(request: dict[str, Any]) -> list[str]:
    """Become the launch's agent process: its output file, folder and environment."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args = [str(a) for a in request["args"]]
    sys.argv = ["torchrun", *args]
    return args


def routes_up(seconds: float, peers: int) -> bool:
    """A node whose veth comes from outside (command.ROUTES_UP, which a cold node runs first)."""
    from workers.launcher.command import ROUTES_UP

    scope: dict[str, Any] = {}
    exec(ROUTES_UP, scope)  # one source for both: the cold node's runs as `python -S -I -c`
    return bool(scope["routes_up"](float(seconds), int(peers)))


def main() -> int:
    server = RankServer() if WARM_RANKS_FLAG in sys.argv[1:] else None
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    request = json.loads(line)
    args = adopt(request)
    if request.get("routes") and not routes_up(*request["routes"]):
        print("torchjobs: the node network never came up", file=sys.stderr, flush=True)
        return 1
    if server is not None:
        args = through_warm_ranks(args, server)
    torchrun.main(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
