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
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

if __name__ == "__main__":  # run as the agent, not imported
    sys.stdout.write("up\n")
    sys.stdout.flush()

import torch.distributed.run as torchrun  # after `up`: the sandbox is set up by then

MARKER = "workers.launcher.warm_agent"  # procs.py recognises a warm agent by it


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


def main() -> int:
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    torchrun.main(adopt(json.loads(line)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
