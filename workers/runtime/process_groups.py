"""Process groups outlive `destroy_process_group()` until the rank's last moment.

A gloo group runs collectives on its own threads. Such a thread frees each finished work a
moment after waking the caller, and that free takes the GIL (the work holds Python objects).
The group's C++ destructor joins those threads. It runs wherever the last reference goes,
which for a DDP model is when the model is freed after `destroy_process_group()` (the
Reducer holds the group): on the main thread, holding the GIL. If a gloo thread is still
freeing its last work then, each waits for the other for ever. Seen with torch 2.13 on the
2-core CI machine under load: a two-rank DDP run that had saved its results hung at exit (2
runs in 17 while other work loaded the machine; py-spy showed `~ProcessGroupGloo` in
`thread::join` and the gloo thread in `gil_scoped_acquire`).

So every group a rank destroys is kept here, and the rank lets go of them only after a pause
that releases the GIL (any freeing left then finishes), just before it exits. The builtin
trainer never lets go at all: it leaves with `os._exit` (exiting.py).
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

QUIET_S = 0.5  # the GIL released this long: every gloo thread has freed what it finished

_KEPT: list[Any] = []


def keep(group: Any = None) -> None:
    """Hold `group` (None: every group there is) so that no later free destroys it."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    _KEPT.extend(list(distributed_c10d._world.pg_map) if group is None else [group])


_ORIGINAL_DESTROY = dist.destroy_process_group


@functools.wraps(_ORIGINAL_DESTROY)
def _kept_destroy(group: Any = None) -> None:
    keep(group)
    _ORIGINAL_DESTROY(group)


def destroy(group: Any = None) -> None:
    """`destroy_process_group(group)`, its groups kept (see the module's docstring); nothing
    when there is no group."""
    if dist.is_available() and dist.is_initialized():
        _kept_destroy(group)


def keep_on_destroy() -> None:
    """A script's own `destroy_process_group()` keeps its groups too (the script cannot know)."""
    dist.destroy_process_group = _kept_destroy
    distributed_c10d.destroy_process_group = _kept_destroy


def let_go(*, destroy_left: bool, quiet_s: float = QUIET_S) -> None:
    """Free the groups a script destroyed (and, with `destroy_left`, after a script that
    succeeded, those it left) while no gloo thread can need the GIL: after a pause, while the
    interpreter is whole. A failed script's groups stay as it left them: destroying an NCCL
    group with a collective stuck on another rank can wait."""
    if destroy_left:
        destroy()
    if not _KEPT:
        return
    gc.collect()  # the script's models: their Reducers drop their references to the kept groups
    time.sleep(quiet_s)
    _KEPT.clear()
    gc.collect()
