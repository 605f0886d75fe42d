"""Imported by the forkserver that starts a rank's DataLoader workers when that server is a
fresh interpreter (loader_workers.py: a rank that already had another thread), and by nothing
else: importing it makes the importing process ignore SIGTERM.

The platform stops a job with SIGTERM to the whole process group, so the rank can finish its
step and save. The forkserver is in that group. If it died of the signal, every worker would
see its parent change, which is how torch's worker watchdog tells that its rank is gone, and
the workers would quit. The rank's next fetch would then fail before it could save. The
server ignores SIGTERM, as the workers do, and still exits when the rank does: it reads a pipe
whose other end only the rank holds, and ends when that end closes. It imports torch once for
all the workers, and it enters the job's own code the way the rank did, so that the job's data
set classes unpickle in the workers.
"""

from __future__ import annotations

import signal

import torch  # noqa: F401 - imported once here, inherited by every worker forked from it

import workers.runtime.trainer.data  # noqa: F401 - the loaders' own wrappers unpickle without an import
from workers.runtime.workdir import enter_workdir, import_first

signal.signal(signal.SIGTERM, signal.SIG_IGN)
_workdir = enter_workdir()
if _workdir is not None:
    import_first(_workdir)
