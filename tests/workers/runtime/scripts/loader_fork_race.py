"""Start many DataLoaders' workers while native threads keep entering Python.

A native thread that calls into Python (a ctypes callback here; torch's gloo threads in a rank)
takes CPython's HEAD_LOCK without the GIL, to make its thread state. On CPython before 3.11.10
a fork at that instant leaves the child waiting on the lock for ever (gh-112275). This runs the
product's validation loader `LOADERS` times, 2 workers each, and prints one line per loader
that delivered every batch; a hung worker leaves its rank waiting, and the caller's timeout
says so.

    python loader_fork_race.py LOADERS [fork]

`fork` forces the start method the runtime used before (to measure the hazard, not in tests).
"""

from __future__ import annotations

import ctypes
import sys
import threading

import torch
from torch.utils.data import TensorDataset

from workers.runtime.trainer import data
from workers.runtime.trainer.data import LoaderOptions, val_loader

CALLBACK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


def _enter_python_from_native_threads(stop: threading.Event) -> None:
    libc = ctypes.CDLL(None)
    callback = CALLBACK(lambda _arg: None)
    tid = ctypes.c_ulong()
    while not stop.is_set():
        libc.pthread_create(ctypes.byref(tid), None, callback, None)
        libc.pthread_join(tid, None)


def main() -> None:
    loaders = int(sys.argv[1])
    if sys.argv[2:] == ["fork"]:
        data.worker_context = lambda *_args: None  # type: ignore[assignment]
    dataset = TensorDataset(torch.arange(64.0).reshape(32, 2), torch.zeros(32, dtype=torch.long))
    opts = LoaderOptions(num_workers=2, pin_memory=False, seed=0, rank=0)
    stop = threading.Event()
    for _ in range(3):
        threading.Thread(target=_enter_python_from_native_threads, args=(stop,), daemon=True).start()
    for i in range(loaders):
        loader = val_loader(dataset, batch_size=8, rank=0, world_size=1, opts=opts)
        total = sum(float(x.sum()) for x, _ in loader)
        assert total == float(torch.arange(64.0).sum()), total
        del loader
        print(f"loader {i + 1} ok", flush=True)
    stop.set()


if __name__ == "__main__":
    main()
