"""The pre-flight: every rank meets every other one before any user code runs.

torchrun's rendezvous only proves that each node reached the master's store. The collectives
that follow open a socket between every pair of ranks, and when that path is broken (a host
announcing an address its peers cannot reach, a firewall, a wrong GLOO_SOCKET_IFNAME) gloo
keeps retrying until the process group's timeout: 30 minutes of a job that looks `running`.
So before the trainer or script starts, each rank joins a private gloo group with a short
timeout and all-reduces a single number. A broken path then fails in seconds, with a message
that names this rank, its node and host, and the stage that failed.

The group is private (its own store prefix, never the default group), and it is gone before
the job's code starts, so a script still calls `init_process_group` exactly as it would
under bare torchrun. It checks the host network with gloo on CUDA hosts too; NCCL's own
transport is first exercised by the job's first collective.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import TypeVar

import torch
import torch.distributed as dist

from workers.runtime.env import RuntimeEnv
from workers.runtime.errors import TorchJobsRuntimeError
from workers.runtime.preflight_product import check_product, known_factor

__all__ = ["PreflightError", "check_gpus", "check_product", "known_factor", "run_preflight"]

STORE_PREFIX = "torchjobs/preflight/"
GPU_CHECK_START_S = 60.0  # the check's interpreter importing torch and creating a CUDA context
T = TypeVar("T")


class PreflightError(TorchJobsRuntimeError):
    """The ranks of a job could not all reach each other within the pre-flight timeout."""


def run_preflight(env: RuntimeEnv) -> float | None:
    """Check this rank's GPUs, then meet every other rank and check a one-element all-reduce;
    seconds taken, None alone."""
    check_gpus(env)
    if env.world_size <= 1:
        return None
    started = time.monotonic()
    timeout = timedelta(seconds=env.preflight_timeout_s)
    store = _stage(env, "reach the rendezvous store", partial(_store, env, timeout))
    group = _stage(env, "connect to every other rank", partial(_gloo_group, env, store, timeout))
    total = _stage(env, "all-reduce a test tensor", partial(_all_reduce_one, group))
    if total != env.world_size:
        raise PreflightError(_where(env) + f": the test all-reduce summed to {total}, not {env.world_size}")
    # Returning drops the last reference to the group: its threads are joined here, before
    # the job's own code runs.
    return time.monotonic() - started


def _stage(env: RuntimeEnv, what: str, step: Callable[[], T]) -> T:
    try:
        return step()
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        raise PreflightError(
            f"{_where(env)}: pre-flight could not {what} within {env.preflight_timeout_s:g} s "
            f"(master {env.master_addr}:{env.master_port}): {_first_line(exc)}. Check that every host "
            "reaches the master's address and every other host's address on the interface named "
            "by GLOO_SOCKET_IFNAME (or the default route)."
        ) from exc


def check_gpus(env: RuntimeEnv) -> None:
    """On CUDA, each GPU this rank drives (all it sees in a DataParallel process, else its
    own) allocates, multiplies and reads back a known product before any user code runs. A
    failing GPU then fails the pre-flight, an infrastructure failure counted against the host
    (contract §8), instead of a job that dies or computes garbage an hour in. In a child process
    (gpu_check.py): this one must not have touched CUDA when the job's code starts."""
    if env.accelerator != "cuda":
        return
    which = "all" if env.local_world_size == 1 or env.own_device else str(env.local_rank)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "workers.runtime.gpu_check", which],
            capture_output=True,
            text=True,
            timeout=env.preflight_timeout_s + GPU_CHECK_START_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise PreflightError(f"{_where(env)}: pre-flight GPU check did not finish in time") from None
    if done.returncode != 0:
        raise PreflightError(f"{_where(env)}: pre-flight could not use {_gpu_failure(done)}")


def _gpu_failure(done: subprocess.CompletedProcess[str]) -> str:
    """`GPU 3: <error>` as gpu_check.py says it (its index is cuda:3 of this rank's
    CUDA_VISIBLE_DEVICES), or the last line of a check that died before it could."""
    said = done.stdout.strip().splitlines()
    if said and said[-1].startswith("GPU "):
        return said[-1] + " (an index into this rank's CUDA_VISIBLE_DEVICES)"
    died = done.stderr.strip().splitlines()
    return f"its GPUs: the check exited with {done.returncode}" + (f": {died[-1][:400]}" if died else "")


def _store(env: RuntimeEnv, timeout: timedelta) -> dist.Store:
    store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=timeout))
    return dist.PrefixStore(STORE_PREFIX, store)


def _gloo_group(env: RuntimeEnv, store: dist.Store, timeout: timedelta) -> dist.ProcessGroupGloo:
    return dist.ProcessGroupGloo(store, env.rank, env.world_size, timeout)


def _all_reduce_one(group: dist.ProcessGroupGloo) -> int:
    tensor = torch.ones(1, dtype=torch.int64)
    group.allreduce([tensor]).wait()  # type: ignore[attr-defined]  # a C++ method torch's stubs omit
    return int(tensor.item())


def _where(env: RuntimeEnv) -> str:
    node = f"node {env.node_rank}" if env.node_rank is not None else "a node"
    return f"rank {env.rank} of {env.world_size} ({node}, host {socket.gethostname()})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:400]
