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

So loader workers start from a forkserver (`multiprocessing`'s own). It is a fresh interpreter,
started by fork+exec with no Python code run in between, and it stays single-threaded, so a
worker forked from it is a fork of a process that has no other thread. That is also where
CPython is going: 3.14 makes it the default on Linux.

The forkserver imports `loader_server.py` first. That module imports torch once for every
worker, enters the job's code as the rank did, and ignores SIGTERM, for the same reason the
workers do (`data._ignore_sigterm`). A worker takes its dataset by pickling, where a forked
worker inherited it:
- tensors go through shared memory (torch's reductions), not copies;
- a dataset that does not pickle (a lambda in a transform, an open handle) keeps the fork start,
  and the rank's log says why.
"""

from __future__ import annotations

import io
import multiprocessing
import pickle
import sys
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import torch

PRELOAD = ["workers.runtime.loader_server"]
FORKSERVER = "forkserver"


def loader_context() -> BaseContext:
    """The forkserver context, with torchjobs' preload (set before the server starts)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context(FORKSERVER)


def start_server(num_workers: int) -> None:
    """Start the forkserver now, so that its torch import overlaps the rank's rendezvous,
    checkpoint load and dataset build instead of delaying the first batch. Returns at once:
    the server imports its preload while it already queues requests."""
    if num_workers > 0:
        loader_context()
        forkserver.ensure_running()


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
