"""Children that get SIGTERM when the thread that started them ends, without a `preexec_fn`.

PR_SET_PDEATHSIG has to be set inside the child. Python's `preexec_fn` runs Python code
between fork and exec, which its documentation calls unsafe in a threaded program: the child
inherits every lock another thread held at the fork and can block on one forever, and then so
does the parent's `Popen`, which waits for the exec. Workers fork from several threads at
once (node tasks, the warm-agent spawner, the heartbeat, Celery's consumer).

So the child execs a tiny Python program first: it sets the signal, checks that its parent is
still the one that started it (the parent may have died before the signal was armed), and
execs the real command line, which keeps the setting (it is only cleared for set-user-ID
programs). The cost is one bare interpreter start (`-S -I`: no site packages), about 15 ms.
"""

from __future__ import annotations

import os
import sys

PARENT_GONE_EXIT = 143  # as if the SIGTERM had arrived

_GUARD = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    f"if os.getppid() != int(sys.argv[1]): sys.exit({PARENT_GONE_EXIT})\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def dying_with_parent(argv: list[str]) -> list[str]:
    """`argv`, run so that it gets SIGTERM when the calling thread (or process) ends.

    Start it with `start_new_session=True` when it needs its own process group: that is done
    by the C code of `subprocess`, which is safe after a fork.
    """
    return [sys.executable, "-S", "-I", "-c", _GUARD, str(os.getpid()), *argv]
