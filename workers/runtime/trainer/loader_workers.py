"""Where a rank's DataLoader workers come from: a forkserver, not a fork of the rank itself.

A rank is a threaded process by the time its loaders start workers (gloo's threads, the loader
queues' feeder threads, the parent watchdog). Forking such a process is unsafe. CPython before
3.11.10 has a known case of it (gh-112275). A native thread that enters Python at the moment
of the fork holds the runtime's HEAD_LOCK. The child then waits on that lock, in
`PyOS_AfterFork_Child`, before it re-initialises it, so it waits for ever. torch's gloo threads
do enter Python after a collective. The result was a job that hung for good on this machine
(Python 3.11.7). Its rank 1 waited in `Queue.get` for a validation worker that was stuck in
`_PyThreadState_DeleteExcept`, and rank 0 waited in the all-reduce after it.
`tests/workers/runtime/test_runtime_loader_workers.py` reproduces the race.

So loader workers start from a forkserver (`multiprocessing`'s). The server stays
single-threaded, so a worker forked from it is a fork of a process that has no other thread.
That is also where CPython is going: 3.14 makes it the default on Linux.

The server costs nothing where it can be a fork of the rank itself. A rank starts it before it
has any other Python thread and before the rendezvous makes gloo's threads (`start_server` runs
before the parent watchdog starts). Its only other threads are then the BLAS library's pool
(OpenBLAS starts one at numpy's import), which never enters Python and is fork-safe by its own
`pthread_atfork` handlers, so the fork cannot inherit a held HEAD_LOCK. That fork already has
torch and the job's code imported. A fresh interpreter has to import torch again: 1.5 s of CPU
on this machine, which put DDP x2's first step 1.7 s later (median of
4 pairs) on two busy cores. The server runs `multiprocessing.forkserver.main`, the stdlib's own
loop, and ignores SIGTERM for the same reason the workers do (`data._ignore_sigterm`). If the
rank already has another thread, or the stdlib's forkserver is not laid out as in 3.11–3.13,
multiprocessing starts its usual fresh interpreter, which imports `loader_server.py` first to
get the same state.

A worker takes its dataset by pickling, where a forked worker inherited it:
- tensors go through shared memory (torch's reductions), not copies;
- a dataset that does not pickle (a lambda in a transform, an open handle) keeps the fork start,
  and the rank's log says why.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
from multiprocessing import connection, forkserver, resource_tracker
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import torch

PRELOAD = ["workers.runtime.trainer.loader_server"]
FORKSERVER = "forkserver"


def loader_context() -> BaseContext:
    """The forkserver context, with torchjobs' preload (set before the server starts)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context(FORKSERVER)


def start_server(num_workers: int) -> None:
    """Start the forkserver now: as a fork of this process while it has a single thread, else
    as multiprocessing's fresh interpreter, whose torch import then overlaps the rendezvous."""
    if num_workers > 0:
        loader_context()
        if not _fork_server():
            forkserver.ensure_running()


_FORKSERVER_FIELDS = ("_lock", "_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd")


def _fork_server() -> bool:
    """`ForkServer.ensure_running`, with `os.fork()` where it execs a fresh interpreter. False
    (nothing done) when this process has another Python thread or the stdlib is laid out
    otherwise."""
    server: Any = forkserver._forkserver  # the stdlib's own singleton
    laid_out = all(hasattr(server, f) for f in _FORKSERVER_FIELDS)
    if not laid_out or hasattr(server, "_forkserver_authkey") or threading.active_count() > 1:
        return False
    with server._lock:
        if server._forkserver_pid is not None:
            return True
        resource_tracker.ensure_running()  # its own fresh interpreter, as ensure_running does
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            # a SIGTERM between the fork and the server's SIG_IGN would kill it: held until then
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            pid = os.fork()
            if pid == 0:
                _serve(listener.fileno(), alive_r, alive_w)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked server: the stdlib's loop until the rank's end of the alive pipe closes."""
    code = 0
    try:
        os.close(alive_w)  # only the rank holds it: its exit is the server's EOF
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def why_not_picklable(dataset: Any) -> str | None:
    """None when `dataset` pickles (its tensors and arrays are not serialised here: they always
    pickle, and a big in-memory data set would be copied for nothing); else the reason."""
    try:
        _SkipArrays(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(dataset)
    except Exception as exc:  # pickling raises whatever the object's reducers raise
        return f"{exc.__class__.__name__}: {exc}"
    return None


def worker_context(dataset: Any, num_workers: int, rank: int) -> BaseContext | None:
    """The context a loader's workers start from: None (no workers, or fork, said in the log)."""
    if num_workers == 0:
        return None
    why = why_not_picklable(dataset)
    if why is not None:
        print(
            f"[torchjobs rank {rank}] the data set does not pickle ({why}): its loader workers are "
            "forked from the rank, which can hang on Python before 3.11.10 (CPython gh-112275)",
            file=sys.stderr,
            flush=True,
        )
        return None
    return loader_context()


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(memoryview(b))


class _SkipArrays(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage, np.ndarray)):
            return id(obj)
        return None
