"""`python -m workers.runtime.script PATH [ARGS...]`: what torchrun runs for script jobs.

A CPU rank first takes its slots' share of the worker's cores (cpus.py). It runs the pre-flight
(preflight.py) across every rank when there is more than one, then the user's file as
`__main__`, with `sys.argv` and `sys.path[0]` as `python PATH ARGS` would set them: the script
is unchanged and sees the same torchrun environment. Its exit (a return, an
exception, `sys.exit`) is its own; `@record` gives a failed pre-flight its place in torchrun's
error file, as for the builtin trainer.
"""

from __future__ import annotations

import gc
import runpy
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from workers.runtime.cpus import use_slot_cpus
from workers.runtime.env import runtime_env
from workers.runtime.mig import take_own_device
from workers.runtime.preflight import run_preflight
from workers.runtime.process_groups import keep_on_destroy, let_go
from workers.runtime.stacks import allow_stack_dumps
from workers.runtime.workdir import enter_workdir, import_first


@record
def preflight() -> None:
    run_preflight(runtime_env())


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m workers.runtime.script PATH [ARGS...]")
    path = Path(argv[0])
    take_own_device()  # MIG: this rank's own instance, before anything touches CUDA
    allow_stack_dumps()  # a silent job's stack, when py-spy cannot attach (contract §8)
    env = runtime_env()
    # A CPU rank's share of the worker's cores, before the script runs; silently: the script's
    # output is the user's, byte for byte (tests/service/streams/test_logs.py).
    use_slot_cpus(env)
    preflight()
    sys.argv = [str(path), *argv[1:]]
    sys.path[0] = str(path.resolve().parent)
    enter_workdir()  # a job with its own code runs in its copy of it
    import_first(path.resolve().parent)
    keep_on_destroy()
    succeeded = False
    try:
        runpy.run_path(str(path), run_name="__main__")
        succeeded = True
    finally:
        # Free what the script left behind (a DDP model keeps its process group alive after
        # destroy_process_group) while the interpreter is whole, and its process groups only
        # once no gloo thread can still need the GIL (process_groups.py). A gloo group first
        # destroyed during interpreter finalization can abort the rank ("terminate called
        # without an active exception", SIGABRT: seen once in CI after a script had succeeded).
        gc.collect()
        let_go(destroy_left=succeeded)


if __name__ == "__main__":
    main(sys.argv[1:])
