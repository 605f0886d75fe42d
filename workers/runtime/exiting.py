"""Leaving a rank's process without interpreter finalisation.

DistributedDataParallel's C++ Reducer keeps its process group alive after
`destroy_process_group()` (measured with torch 2.13: the gloo worker threads are still there
after `del ddp; gc.collect()`). Such a worker thread frees each finished collective, and with
it the Python-owned tensors of earlier collectives the barrier chained, a moment after the
caller has been woken. If the interpreter is finalising by then, the decref cannot take the GIL,
the thread is unwound inside a noexcept destructor and the rank dies with SIGABRT ("terminate
called without an active exception") after a successful run: 6 of 25 DDP x2 runs on this
2-core machine. So a rank flushes what it wrote, lets collectable objects go while the
interpreter is whole (DataLoader workers are shut down by their iterators' finalisers), and
leaves with `os._exit`, which runs no finaliser that could race those threads.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import traceback
from collections.abc import Callable


def flush_and_exit(code: int, *, exit_now: Callable[[int], None] = os._exit) -> None:
    """Flush stdio and logging, collect garbage, then end the process with `code`."""
    gc.collect()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing left to save
            stream.flush()
    exit_now(code)


def exit_code_of(stop: SystemExit) -> int:
    """The status the interpreter itself would give: None is 0, a message is 1."""
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 1


def run_then_exit(main: Callable[[], int | None], *, exit_now: Callable[[int], None] = os._exit) -> None:
    """Run `main` as a process entry point: its return value is the exit status, an uncaught
    exception prints its traceback (as the interpreter would) and exits 1, SystemExit keeps
    its code."""
    try:
        returned = main()
        code = 0 if returned is None else returned  # torch's @record turns SystemExit(0) into None
    except SystemExit as stop:  # argparse's usage errors (2) and --help (None: success)
        code = exit_code_of(stop)
    except BaseException:  # the entry point reports every failure itself
        traceback.print_exc()
        code = 1
    flush_and_exit(code, exit_now=exit_now)
