"""A rank's destroyed process groups stay alive until it lets go of them (process_groups.py):
the builtin trainer's teardown and a script's own `destroy_process_group()` alike. One gloo
process (world size 1) in this interpreter; the hang they prevent is a race, shown by
test_runtime_ddp_knobs.py's two real ranks."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d

from workers.runtime import process_groups


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        process_groups._ORIGINAL_DESTROY()
    process_groups._KEPT.clear()


def test_the_trainers_teardown_keeps_the_group(world: None) -> None:
    group = weakref.ref(dist.group.WORLD)
    process_groups.destroy()
    gc.collect()
    assert not dist.is_initialized()
    assert group() is not None and group() in process_groups._KEPT
    process_groups.let_go(destroy_left=True, quiet_s=0.01)
    gc.collect()
    assert group() is None and not process_groups._KEPT


def test_a_scripts_own_destroy_keeps_the_group(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (dist, distributed_c10d):  # put back after the test: this is pytest's torch
        monkeypatch.setattr(module, "destroy_process_group", module.destroy_process_group)
    process_groups.keep_on_destroy()
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    assert not dist.is_initialized() and group() is not None


def test_a_succeeded_script_s_groups_are_destroyed_for_it(world: None) -> None:
    """A script that never called destroy_process_group: its group goes before the rank ends,
    while the interpreter is whole; a failed script's stays as it was."""
    process_groups.let_go(destroy_left=False, quiet_s=0.01)
    assert dist.is_initialized()
    process_groups.let_go(destroy_left=True, quiet_s=0.01)
    assert not dist.is_initialized() and not process_groups._KEPT
