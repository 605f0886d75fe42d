"""Which physical GPU each of a worker's slots is, and which device files that GPU has.

A worker's slots are numbered 0..N-1, but the GPUs they stand for are the worker's own
`CUDA_VISIBLE_DEVICES` list, in its order and whatever its form: indices (`4,5,6,7`: two
workers sharing an 8-GPU box), UUIDs (`GPU-8f2c…`) or MIG instances (`MIG-…`). Slot i is the
i-th entry; a rank gets the entries of its node's slots, so it runs on the GPUs its worker
was given, never on GPU 0 of the box. Pure functions, apart from asking `nvidia-smi`.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NVIDIA_CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
# RDMA (InfiniBand, RoCE): NCCL's IB transport opens uverbs and rdma_cm here; without them in
# the sandbox a multi-node job falls back to TCP sockets, silently, at a fraction of the speed.
RDMA_DEVICES = ("/dev/infiniband",)


@dataclass(frozen=True)
class Gpu:
    index: int  # nvidia-smi's (PCI order), which a bare number in CUDA_VISIBLE_DEVICES means
    uuid: str
    minor: int  # /dev/nvidiaN


def slot_ids(visible: str | None, slots: int) -> tuple[str, ...]:
    """The physical id behind each slot: the worker's own CUDA_VISIBLE_DEVICES entries (the
    first `slots` of them), or 0..slots-1 when it has none."""
    if visible is None or not visible.strip():
        return tuple(str(i) for i in range(slots))
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if len(entries) < slots:
        raise ValueError(f"{slots} GPU slots, but CUDA_VISIBLE_DEVICES lists {len(entries)}: {visible!r}")
    return tuple(entries[:slots])


def device_files(ids: Sequence[str], gpus: Sequence[Gpu]) -> tuple[str, ...]:
    """The device files a node on those GPUs needs: its own cards, found by index or UUID
    (a unique prefix, as CUDA takes it), the driver's control files, and the RDMA devices
    (bound where the host has them). When one of them
    cannot be told (a MIG name, no nvidia-smi), every card's: CUDA_VISIBLE_DEVICES still
    selects, the wall between jobs on one host is then that variable only."""
    cards = [_card(i, gpus) for i in ids]
    if any(c is None for c in cards):
        listed = sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))
    else:
        listed = [f"/dev/nvidia{c}" for c in cards]
    caps_dir = Path("/dev/nvidia-caps")
    caps = sorted(str(p) for p in caps_dir.glob("*")) if caps_dir.is_dir() else []
    return (*NVIDIA_CONTROL, *listed, *caps, *RDMA_DEVICES)


def cuda_visible(ids: Sequence[str], gpus: Sequence[Gpu]) -> tuple[str, ...]:
    """What a node's ranks get as CUDA_VISIBLE_DEVICES: each of its GPUs by full UUID wherever
    nvidia-smi told which card an id is. A sandbox holds only the node's own cards, and CUDA
    numbers the cards it finds from 0, so a host index (`1`, or `5` on a worker given `4-7`)
    names a card that is not there, or another one; a UUID names the same card inside the
    sandbox and out, whatever CUDA_DEVICE_ORDER says. MIG names are already unique; an id that
    cannot be told is left as it is (the sandbox then holds every card, see device_files)."""
    return tuple(gpu.uuid if (gpu := _gpu(i, gpus)) else i for i in ids)


def _card(device_id: str, gpus: Sequence[Gpu]) -> int | None:
    gpu = _gpu(device_id, gpus)
    return gpu.minor if gpu else None


def _gpu(device_id: str, gpus: Sequence[Gpu]) -> Gpu | None:
    """The card an id names: by index, or by a unique UUID prefix (as CUDA takes it)."""
    if device_id.isdigit():
        return next((g for g in gpus if g.index == int(device_id)), None)
    if device_id.startswith("GPU-"):
        found = [g for g in gpus if g.uuid.startswith(device_id)]
        return found[0] if len(found) == 1 else None
    return None  # MIG-…: its parent GPU is not in the name


def nvidia_gpus() -> tuple[Gpu, ...]:
    """Every GPU of the host as nvidia-smi lists it; empty when it cannot tell."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    query = [smi, "--query-gpu=index,uuid,minor_number", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
        rows = [[part.strip() for part in line.split(",")] for line in out.strip().splitlines()]
        return tuple(Gpu(index=int(i), uuid=u, minor=int(m)) for i, u, m in rows)
    except (OSError, ValueError, subprocess.SubprocessError):
        return ()
