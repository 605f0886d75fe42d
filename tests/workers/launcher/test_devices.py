"""Slot i is the i-th GPU of the worker's own CUDA_VISIBLE_DEVICES, whatever its form (#22)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.launcher.command import NodeLaunch, build_launch
from workers.launcher.devices import Gpu, cuda_visible, device_files, slot_ids
from workers.launcher.sandbox import Isolation

HOST = (
    Gpu(index=0, uuid="GPU-aaaa0000-0000", minor=0),
    Gpu(index=4, uuid="GPU-bbbb4444-4444", minor=4),
    Gpu(index=5, uuid="GPU-cccc5555-5555", minor=5),
    Gpu(index=6, uuid="GPU-dddd6666-6666", minor=6),
    Gpu(index=7, uuid="GPU-eeee7777-7777", minor=7),
)


def _cuda_launch(device_ids: tuple[str, ...], gpus: tuple[int, ...], sandboxed: bool = False) -> NodeLaunch:
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap="/bw", uid=9, gid=9) if sandboxed else None
    return NodeLaunch(
        job_id=1, attempt=1, node_rank=0, nnodes=1, mode="ddp", gpus=gpus, accelerator="cuda",
        master_addr="127.0.0.1", master_port=29500, entrypoint={"kind": "builtin"}, hyperparameters={},
        script_path=None, run_dir=Path("/runs/1"), python="/py", device_ids=device_ids,
        devices=device_files(device_ids, HOST) if sandboxed else (),
        **({"isolation": iso} if iso else {}),
    )  # fmt: skip


def test_a_worker_given_gpus_4_to_7_runs_its_slots_on_them() -> None:
    ids = slot_ids("4,5,6,7", 4)
    assert ids == ("4", "5", "6", "7")
    # a job on slots 2 and 3 runs on GPUs 6 and 7, not 2 and 3
    env = build_launch(_cuda_launch(tuple(ids[g] for g in (2, 3)), (2, 3))).env
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_uuid_and_mig_names_pass_through_as_they_are() -> None:
    ids = slot_ids("GPU-bbbb4444-4444, MIG-1234-abcd/0/0", 2)
    assert ids == ("GPU-bbbb4444-4444", "MIG-1234-abcd/0/0")
    env = build_launch(_cuda_launch(ids, (0, 1))).env
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb4444-4444,MIG-1234-abcd/0/0"
    # MIG: each rank narrows it to its own entry (workers/runtime/mig.py)
    assert env["TORCHJOBS_RANK_DEVICES"] == env["CUDA_VISIBLE_DEVICES"]
    assert "TORCHJOBS_RANK_DEVICES" not in build_launch(_cuda_launch(("4", "5"), (0, 1))).env


def test_no_list_means_the_slot_numbers_and_too_short_a_list_is_refused() -> None:
    assert slot_ids(None, 3) == ("0", "1", "2") == slot_ids("", 3)
    assert slot_ids("3,1,2", 2) == ("3", "1")  # --gpus 2 takes the first two, in the worker's order
    with pytest.raises(ValueError, match="lists 2"):
        slot_ids("0,1", 4)


def test_a_sandbox_holds_only_its_own_gpus_device_files() -> None:
    files = device_files(("6", "7"), HOST)
    assert "/dev/nvidia6" in files and "/dev/nvidia7" in files
    assert "/dev/nvidia0" not in files and "/dev/nvidia4" not in files
    assert "/dev/nvidiactl" in files and "/dev/nvidia-uvm" in files
    assert "/dev/nvidia5" in device_files(("GPU-cccc",), HOST)  # a UUID prefix, as CUDA takes it
    argv = build_launch(_cuda_launch(("6", "7"), (2, 3), sandboxed=True)).argv
    bound = {argv[i + 1] for i, a in enumerate(argv) if a == "--dev-bind-try"}
    assert {"/dev/nvidia6", "/dev/nvidia7"} <= bound and "/dev/nvidia4" not in bound


def test_a_gpu_it_cannot_tell_binds_every_card() -> None:
    """A MIG instance names no parent GPU, and without nvidia-smi nothing can be told: every
    card's file (whatever this host's /dev holds), and CUDA_VISIBLE_DEVICES selects."""
    every = tuple(sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*")))
    control = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
    assert device_files(("MIG-1234-abcd/0/0",), HOST)[: 4 + len(every)] == (*control, *every)
    assert device_files(("6",), ())[: 4 + len(every)] == (*control, *every)


def test_the_ranks_name_their_gpus_by_uuid_so_the_sandboxs_numbering_cannot_mislead() -> None:
    """In a sandbox holding only /dev/nvidia5, CUDA calls that card 0: "5" would name nothing
    (#37). Index, UUID prefix and full UUID all become the card's full UUID; MIG names and ids
    nvidia-smi could not tell stay as they are."""
    assert cuda_visible(("5",), HOST) == ("GPU-cccc5555-5555",)
    assert cuda_visible(("6", "7"), HOST) == ("GPU-dddd6666-6666", "GPU-eeee7777-7777")
    assert cuda_visible(("GPU-cccc",), HOST) == ("GPU-cccc5555-5555",)
    assert cuda_visible(("GPU-eeee7777-7777",), HOST) == ("GPU-eeee7777-7777",)
    assert cuda_visible(("MIG-1234-abcd/0/0",), HOST) == ("MIG-1234-abcd/0/0",)
    assert cuda_visible(("3",), HOST) == ("3",)  # not in nvidia-smi's list: as given
    assert cuda_visible(("5",), ()) == ("5",)  # no nvidia-smi: the sandbox holds every card
    ids = cuda_visible(slot_ids("4,5,6,7", 4)[2:], HOST)
    launch = _cuda_launch(ids, (2, 3), sandboxed=True)
    assert build_launch(launch).env["CUDA_VISIBLE_DEVICES"] == "GPU-dddd6666-6666,GPU-eeee7777-7777"
    bound = {a for a in build_launch(launch).argv if a.startswith("/dev/nvidia")}
    assert {"/dev/nvidia6", "/dev/nvidia7"} <= bound and "/dev/nvidia5" not in bound


def test_rdma_devices_reach_a_cuda_sandbox_where_the_host_has_them() -> None:
    """NCCL's InfiniBand/RoCE transport opens /dev/infiniband/uverbsN and rdma_cm; without them
    a multi-node job falls back to TCP without a word (#37). Bound "-try": a host without RDMA
    starts the same sandbox."""
    assert "/dev/infiniband" in device_files(("6",), HOST)
    argv = build_launch(_cuda_launch(("6",), (2,), sandboxed=True)).argv
    assert "/dev/infiniband" in {argv[i + 1] for i, a in enumerate(argv) if a == "--dev-bind-try"}


def test_the_admins_binds_are_absolute_paths() -> None:
    from pydantic import ValidationError

    from service.config import Settings

    binds = Settings(sandbox_binds="/opt/nccl-plugin, /usr/lib/x86_64-linux-gnu/libibverbs")
    assert binds.sandbox_bind_paths == ("/opt/nccl-plugin", "/usr/lib/x86_64-linux-gnu/libibverbs")
    for bad in ("opt/plugin", "/opt/../etc"):
        with pytest.raises(ValidationError, match="TORCHJOBS_SANDBOX_BINDS"):
            Settings(sandbox_binds=bad)
