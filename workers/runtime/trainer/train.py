"""`python -m workers.runtime.trainer.train --config config.json`: what torchrun runs for builtin and
factory jobs (one process per rank).

A rank stops cleanly on SIGTERM (see ../preemption.py), and also when torchrun itself dies.
Every rank first meets every other one (../preflight.py), so a broken network fails in seconds.
Following torchrun's advice, the checkpoint is loaded next (ranks are not stable across
restarts, so all state comes from the checkpoint), then the process group is joined, then
training runs. `@record` writes a failing rank's traceback to torchrun's error file, which the
platform reads to name the root cause; the process group is destroyed on every exit path, and
the process ends with `os._exit` once its output is flushed (../exiting.py says why).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from workers.runtime.cpus import describe, use_slot_cpus
from workers.runtime.dcp_checkpoint import DcpResume, load_resume_source
from workers.runtime.env import RuntimeEnv, runtime_env
from workers.runtime.errors import PREEMPTED_EXIT_CODE, Preempted
from workers.runtime.exiting import run_then_exit
from workers.runtime.mig import take_own_device
from workers.runtime.preemption import ParentWatchdog, PreemptionFlag
from workers.runtime.preflight import run_preflight
from workers.runtime.stacks import allow_stack_dumps
from workers.runtime.trainer.config import TrainConfig, load_config
from workers.runtime.trainer.distributed import (
    DistContext,
    barrier,
    describe_placement,
    init_distributed,
    teardown_distributed,
)
from workers.runtime.trainer.loader_workers import start_server as start_loader_server
from workers.runtime.trainer.loop import Resume, Trainer, log
from workers.runtime.trainer.plan import RunPlan, make_plan
from workers.runtime.workdir import enter_workdir, import_first


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.runtime.trainer.train")
    parser.add_argument("--config", type=Path, required=True, help="the job's config.json")
    return parser.parse_args(argv)


@record
def main(argv: list[str] | None = None) -> int:
    """0 when training completed, PREEMPTED_EXIT_CODE after a SIGTERM; raises on errors."""
    args = _parse_args(argv)
    take_own_device()  # MIG: this rank's own instance, before anything touches CUDA
    allow_stack_dumps()  # a silent job's stack, when py-spy cannot attach (contract §8)
    flag = PreemptionFlag().install()
    env = runtime_env()
    config = load_config(args.config)
    workdir = enter_workdir()  # a job with its own code: its factories import from its copy
    if workdir is not None:
        import_first(workdir)
    plan = make_plan(config, env, cuda_device_count=torch.cuda.device_count())
    cpus = use_slot_cpus(env)  # CPU: pinned to its slots' cores; CUDA: threads capped at them
    if cpus is not None:
        share = describe(cpus) if not plan.is_cuda else f"{torch.get_num_threads()} CPU threads at most"
        log(env.rank, f"slots {','.join(map(str, env.slots or ()))}: {share}")
    # after the CPUs and the workdir (the server inherits both), before any other thread (it
    # is then a fork of this process: loader_workers.py)
    start_loader_server(config.hyperparameters.num_workers)
    if env.under_torchrun:
        ParentWatchdog(flag).start()
    preflight_s = run_preflight(env)
    if preflight_s is not None and env.rank == 0:
        log(env.rank, f"pre-flight: all {env.world_size} ranks reached each other in {preflight_s:.2f} s")
    # a file, or for fsdp a DCP folder (its shards load once the model is sharded)
    resume = load_resume_source(env.resume_from, config.mode) if env.resume_from is not None else None
    try:
        ctx = init_distributed(plan)
        log(env.rank, describe_placement(plan))
        code = _train(config=config, plan=plan, env=env, ctx=ctx, flag=flag, resume=resume)
        barrier(ctx)  # leave the group together, not while a peer is still mid-exchange
        return code
    finally:
        teardown_distributed()


def _train(
    *,
    config: TrainConfig,
    plan: RunPlan,
    env: RuntimeEnv,
    ctx: DistContext,
    flag: PreemptionFlag,
    resume: Resume | DcpResume | None,
) -> int:
    """Run the trainer; it and its DDP wrapper are gone on return. The wrapper's Reducer still
    keeps the process group's threads alive, which is why the process ends through
    `run_then_exit` (see ../exiting.py)."""
    try:
        return Trainer(config=config, plan=plan, env=env, ctx=ctx, flag=flag, resume=resume).run()
    except Preempted:
        log(ctx.rank, f"preempted: exiting with {PREEMPTED_EXIT_CODE}")
        return PREEMPTED_EXIT_CODE


if __name__ == "__main__":
    run_then_exit(main)
