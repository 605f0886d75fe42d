"""One MIG device per process: a rank's own entry of its node's MIG instances.

CUDA enumerates at most one MIG instance per process, the first of CUDA_VISIBLE_DEVICES: with
`MIG-a,MIG-b` every rank of a node sees only `MIG-a`, so a `ddp` rank with LOCAL_RANK 1 finds
no device, and two ranks on `MIG-a` would share it. The launcher passes the node's instances in
TORCHJOBS_RANK_DEVICES (contract §4's CUDA_VISIBLE_DEVICES still names them all), and each
process narrows CUDA_VISIBLE_DEVICES to its own before anything touches CUDA: local rank i takes
entry i, and sees it as `cuda:0`. A `single` or `dp` process keeps the first (DataParallel over
several MIG instances is impossible in one process; its plan says so).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

RANK_DEVICES = "TORCHJOBS_RANK_DEVICES"


def take_own_device(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Narrow CUDA_VISIBLE_DEVICES to this rank's MIG instance; the instance, or None where the
    launcher gave no per-rank list. Call first thing in the rank, before CUDA is initialised."""
    env = os.environ if environ is None else environ
    devices = [d.strip() for d in env.get(RANK_DEVICES, "").split(",") if d.strip()]
    if not devices:
        return None
    local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    own = devices[local_rank] if local_rank < len(devices) else devices[0]
    env["CUDA_VISIBLE_DEVICES"] = own
    return own
