"""A pipe that tells every sandbox its worker is gone, however the worker died.

PR_SET_PDEATHSIG cannot do it for a sandbox: the signal is sent with the dying parent's
credentials, and the parent of a sandbox's PID 1 is bubblewrap's outer process (root, its
capabilities dropped), which may not signal the job's uid; the kernel drops the signal without
a word. Measured: a worker SIGKILLed mid-job left torchrun and a SIGTERM-ignoring rank running,
unseen, until something else killed them (issue #35).

So the worker process holds the write end of one pipe for its whole life, never written to,
and every sandbox's first program (`sandbox.ENTRY`, its PID 1) holds a read end. When the
worker process ends, by any signal, the kernel closes the write end and the read end turns
readable (end of file): PID 1 asks everything in the sandbox to stop (SIGTERM), waits
`ORPHAN_GRACE_S`, then exits, and the kernel kills whatever is left of its PID namespace.
No permission check is involved, and nothing of the job can hold the write end: it is
close-on-exec in the worker, and the ranks never get even the read end (PID 1 closes it in
the child it runs torchrun in).
"""

from __future__ import annotations

import os
import threading

ORPHAN_GRACE_S = 10.0  # a rank's time to flush after its worker died (nobody can store it)

_lock = threading.Lock()
_ends: tuple[int, int, int] | None = None  # (the process it was made in, read end, write end)


def read_end() -> int:
    """This process's read end, made on first use (again in a forked child, which must not
    count on its parent's write end)."""
    global _ends
    with _lock:
        if _ends is None or _ends[0] != os.getpid():
            read, write = os.pipe()  # both close-on-exec: no child holds the write end
            _ends = (os.getpid(), read, write)
        return _ends[1]


def pass_fds() -> tuple[int, ...]:
    """For `subprocess.Popen(pass_fds=...)` of a command line made by `sandbox.wrap`."""
    return (read_end(),)
