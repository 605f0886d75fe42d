"""The builtin trainer: one loop for single, dp, ddp and fsdp, resumable to the batch.

Where training stands is a `Position` (completed epochs, batches into the current epoch, global
step). Because the data order of epoch e is a function of (seed, e) alone (see data.py) and the
RNG states travel in the checkpoint, resuming at a Position replays exactly what the
uninterrupted run would have done next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from workers.runtime.checkpoint import (
    build_checkpoint,
    checkpoint_name,
    fit_state_dict,
    unwrap_model,
    write_atomic,
)
from workers.runtime.dcp_checkpoint import (
    DcpResume,
    folder_name,
    remove_stale_folder,
    write_trainer_state,
)
from workers.runtime.env import RuntimeEnv
from workers.runtime.errors import CheckpointError, ConfigError, Preempted
from workers.runtime.events import report
from workers.runtime.preemption import PreemptionFlag
from workers.runtime.trainer import debug
from workers.runtime.trainer.config import TrainConfig
from workers.runtime.trainer.data import EpochBatchSampler, LoaderOptions, train_loader, val_loader
from workers.runtime.trainer.distributed import (
    DistContext,
    StopAgreement,
    all_reduce_sum,
    barrier,
    gather_to_main,
    seed_everything,
)
from workers.runtime.trainer.factory import load_datasets, load_model
from workers.runtime.trainer.fsdp import (
    DcpSaver,
    blocking_saves_asked,
    checkpoint_group,
    forwards_behind,
    full_state,
    gradient_sync,
    load_sharded,
    pad_forwards,
)
from workers.runtime.trainer.parallel import PlacedModel, load_optimizer_state, make_optimizer, place_model
from workers.runtime.trainer.plan import RunPlan
from workers.runtime.trainer.rng import capture_rng, restore_rng
from workers.runtime.trainer.stepping import Grouping, Stepper
from workers.runtime.version import torchjobs_version

Resume = tuple[dict[str, torch.Tensor], dict[str, Any] | None, int, int, dict[str, Any]]
T = TypeVar("T")


def log(rank: int, message: str) -> None:
    print(f"[torchjobs rank {rank}] {message}", file=sys.stderr, flush=True)


@dataclass(kw_only=True)
class Position:
    epoch: int  # completed epochs
    batch: int  # batches completed inside epoch `epoch` (0 at a boundary)
    step: int  # completed optimizer steps, all epochs

    def advance(self, batches_per_epoch: int) -> None:
        self.step += 1
        self.batch += 1
        if self.batch == batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0


class _Meter:
    """Loss summed on the device (no per-step host sync) and training time, over two windows:
    since the last report, and since the epoch began (validation and saving are not timed)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.start_epoch()

    def start_epoch(self) -> None:
        self.epoch = self._fresh()
        self.reset_window()

    def reset_window(self) -> None:
        self.window = self._fresh()

    def _fresh(self) -> dict[str, Any]:
        return {"loss": torch.zeros((), device=self._device), "steps": 0, "t0": time.perf_counter()}

    def add(self, loss: torch.Tensor) -> None:
        for acc in (self.epoch, self.window):
            acc["loss"] += loss
            acc["steps"] += 1


class Trainer:
    """Builds everything for one rank, then trains; `run` returns 0 or raises Preempted."""

    def __init__(
        self,
        *,
        config: TrainConfig,
        plan: RunPlan,
        env: RuntimeEnv,
        ctx: DistContext,
        flag: PreemptionFlag,
        resume: Resume | DcpResume | None,
    ) -> None:
        self.config = config
        self.hp = config.hyperparameters.for_world(ctx.world_size)
        self.plan = plan
        self.env = env
        self.ctx = ctx
        self.flag = flag
        seed_everything(self.hp.seed + ctx.rank)
        self._say_when_dp_is_single()
        self.model = self._build_model(resume)
        self.optimizer = make_optimizer(self.model.bare, self.hp)
        self.saver = self._sharded_setup(resume) if plan.mode == "fsdp" else None
        self.stepper = Stepper(self.optimizer, self.hp, ctx.device)
        self.probe: torch.Tensor | None = None  # one input sample (fsdp's validation padding)
        if self.hp.compile:  # the bare model stays what is saved: no `_orig_mod.` in checkpoints
            compiled = cast(torch.nn.Module, torch.compile(self.model.train))
            self.model = dataclasses.replace(self.model, train=compiled)
        self.sampler, self.train_loader, self.val_loader = self._build_data()
        self.per_epoch = self.sampler.batches_per_epoch
        self.total_steps = self.per_epoch * self.hp.epochs
        self.grouping = Grouping(self.per_epoch, self.hp.grad_accum_steps)
        self.total_opt_steps = self.grouping.groups_per_epoch * self.hp.epochs
        self.last_save_at = time.monotonic()
        self.pos = Position(epoch=0, batch=0, step=0)
        if resume is not None:
            self._resume(resume)
        self.saved_step = self.pos.step  # nothing new to save until a step is taken
        self.stop = StopAgreement(ctx)
        self.meter = _Meter(ctx.device)

    # ---------------------------------------------------------------- setup

    def _say_when_dp_is_single(self) -> None:
        """DataParallel splits a batch over GPUs only: a `dp` job on the CPU, or on one GPU, is
        single-process training on one device, which its log says plainly (a job on two CPU
        slots would otherwise look like it uses both)."""
        if self.plan.mode != "dp" or len(self.plan.dp_device_ids) > 1:
            return
        where = "one GPU" if self.plan.is_cuda else "the CPU"
        log(
            self.ctx.rank,
            f"mode dp on {where} is single-process training on one device, the same as mode "
            "single: DataParallel spreads a batch over two or more GPUs only (on the CPU, ddp "
            "runs one process per slot)",
        )

    def _node_leader_first(self, build: Callable[[], T]) -> T:
        """Call a factory on each node's local rank 0 first, then on the node's other ranks.

        A factory may download or cache (a dataset, pretrained weights) into a place the ranks
        of a node share; called by all at once, they would race to fetch and write it. So, as
        the seed does, local rank 0 builds while the others wait at a barrier, and they build
        after it, finding the cache ready. (The barrier is global: every node's leader builds at
        once, then everyone else.) Builtins read nothing from outside and skip the wait.
        """
        if self.config.entrypoint.kind != "factory" or not self.ctx.distributed:
            return build()
        if self.env.local_rank == 0:
            built = build()
            barrier(self.ctx)
            return built
        barrier(self.ctx)
        return build()

    def _build_model(self, resume: Resume | DcpResume | None) -> PlacedModel:
        model = self._node_leader_first(lambda: load_model(self.config.entrypoint))
        if isinstance(resume, tuple):  # a file; a DCP folder loads into the sharded model
            target = unwrap_model(model)  # a factory may hand over a wrapped model
            try:
                target.load_state_dict(fit_state_dict(resume[0], target))
            except RuntimeError as exc:
                raise CheckpointError(f"checkpoint weights do not fit the model: {exc}") from exc
        return place_model(model, self.plan, self.config.hyperparameters)

    def _sharded_setup(self, resume: Resume | DcpResume | None) -> DcpSaver:
        """fsdp: the checkpoint group and saver; a DCP folder's tensors into the shards (the
        job's lr and weight decay win over the saved ones, as for a file)."""
        group = checkpoint_group()
        if isinstance(resume, DcpResume):
            load_sharded(resume.path, self.model.bare, self.optimizer, group)
            for param_group in self.optimizer.param_groups:
                param_group["lr"], param_group["weight_decay"] = self.hp.lr, self.hp.weight_decay
            self._debug_full_state("resumed")
        return DcpSaver(group, blocking=blocking_saves_asked(os.environ))

    def _debug_full_state(self, name: str) -> None:
        """Test-only (TORCHJOBS_DEBUG_DUMP_DIR): the unsharded model and optimizer state,
        gathered to rank 0."""
        if self.env.debug_dump_dir is None:
            return
        full = full_state(self.model.bare, self.optimizer)  # a collective: every rank gathers
        if self.ctx.is_main:
            self.env.debug_dump_dir.mkdir(parents=True, exist_ok=True)
            torch.save(full, self.env.debug_dump_dir / f"full-{name}.pt")

    def _build_data(self) -> tuple[EpochBatchSampler, DataLoader, DataLoader | None]:
        train_set, val_set = self._node_leader_first(lambda: load_datasets(self.config.entrypoint, self.hp))
        sampler = EpochBatchSampler(
            train_set,
            batch_size=self.hp.batch_size,
            num_replicas=self.ctx.world_size,
            rank=self.ctx.rank,
            seed=self.hp.seed,
            record=self.env.debug_dump_dir is not None,
        )
        if sampler.batches_per_epoch == 0:
            raise ConfigError(
                f"the training set ({len(cast(Sized, train_set))} samples) has no full batch of "
                f"{self.hp.batch_size} "
                f"per process over {self.ctx.world_size} processes"
            )
        opts = LoaderOptions(
            num_workers=self.hp.num_workers,
            pin_memory=self.plan.is_cuda,
            seed=self.hp.seed,
            rank=self.ctx.rank,
        )
        val = None
        if val_set is not None:
            val = val_loader(
                val_set,
                batch_size=self.hp.batch_size,
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                opts=opts,
            )
        return sampler, train_loader(train_set, sampler, opts), val

    def _resume(self, resume: Resume | DcpResume) -> None:
        """Optimizer state, position and RNG from the checkpoint (its weights are already loaded;
        a DCP folder's optimizer state too)."""
        if isinstance(resume, DcpResume):
            opt_state, epoch, meta = None, resume.epoch, resume.meta
        else:
            _net, opt_state, epoch, _step, meta = resume
        if opt_state is not None:
            self._warn(load_optimizer_state(self.optimizer, opt_state, self.hp))
        self.stepper.load_state(meta.get("grad_scaler"))
        batch = meta.get("batch_in_epoch", 0)
        if not isinstance(batch, int) or not 0 <= batch < self.per_epoch or not self._same_geometry(meta):
            if batch:
                self._warn(
                    f"the checkpoint stopped inside epoch {epoch + 1} with another batch layout; "
                    "that epoch restarts from its beginning"
                )
            batch = 0
        self.pos = Position(epoch=epoch, batch=batch, step=epoch * self.per_epoch + batch)
        self._restore_rng(meta)
        log(self.ctx.rank, f"resuming at epoch {epoch} (+{batch} batches), step {self.pos.step}")

    def _same_geometry(self, meta: dict[str, Any]) -> bool:
        saved = meta.get("hyperparameters")
        return (
            meta.get("world_size") == self.ctx.world_size
            and isinstance(saved, dict)
            and saved.get("batch_size") == self.hp.batch_size
            and saved.get("grad_accum_steps", 1) == self.hp.grad_accum_steps
        )

    def _restore_rng(self, meta: dict[str, Any]) -> None:
        ranks = meta.get("rng", {}).get("ranks") if isinstance(meta.get("rng"), dict) else None
        if not isinstance(ranks, list) or len(ranks) != self.ctx.world_size:
            self._warn("the checkpoint holds no RNG state for this world size; random streams start afresh")
            return
        try:
            restore_rng(ranks[self.ctx.rank])
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            self._warn(f"could not restore the RNG state ({exc!r}); random streams start afresh")

    def _warn(self, message: str | None) -> None:
        if message and self.ctx.is_main:
            log(self.ctx.rank, f"warning: {message}")

    # ---------------------------------------------------------------- training

    def run(self) -> int:
        """Train the remaining epochs; 0 when done."""
        if self.pos.epoch >= self.hp.epochs:
            done = f"{self.pos.epoch} of {self.hp.epochs}"
            log(self.ctx.rank, f"nothing to train: the checkpoint has already completed {done} epochs")
            return 0
        while self.pos.epoch < self.hp.epochs:
            epoch = self.pos.epoch
            summary = self._train_epoch(epoch)
            if self.env.debug_dump_dir is not None:
                debug.dump_epoch(
                    self.env.debug_dump_dir,
                    rank=self.ctx.rank,
                    epoch=epoch,
                    batches=self.sampler.handed_out,
                    model=self.model.bare,
                )
            if self.stop.settle(self.flag.requested):
                self._preempt()
            self._end_epoch(summary)
        if self.saver is not None:
            self.saver.wait()  # the last checkpoint is complete before the rank exits
        return 0

    def _train_epoch(self, epoch: int) -> dict[str, Any]:
        """Train to the end of the epoch; its progress summary, timed before validation."""
        self.sampler.set_epoch(epoch, skip_batches=self.pos.batch)
        self.model.train.train()
        self.meter.start_epoch()
        for batch in self.train_loader:
            stepped = self._step(batch)
            self.pos.advance(self.per_epoch)
            if stepped:  # stops and saves fall between optimizer steps, never inside a group
                if self.stop.after_step(self.flag.requested, self._save_due()):
                    self._preempt()
                if self.stop.take_save() and self.pos.batch != 0:
                    self._save()
            if self.pos.step % self.hp.report_every == 0 and self.pos.batch != 0:
                self._publish(self._summarise(self.meter.window))
        return self._summarise(self.meter.epoch)

    def _step(self, batch: Any) -> bool:
        """One batch; True when it ended its accumulation group with an optimizer step."""
        if not isinstance(batch, list | tuple) or len(batch) != 2:
            raise ConfigError("every training sample must be an (input, target) pair")
        non_blocking = self.plan.is_cuda
        x = batch[0].to(self.ctx.device, non_blocking=non_blocking)
        y = batch[1].to(self.ctx.device, non_blocking=non_blocking)
        b, group = self.pos.batch, self.grouping
        if group.is_first(b):
            self.optimizer.zero_grad(set_to_none=True)
        last = group.is_last(b)
        if self.probe is None:
            self.probe = x[:1]
        with self._no_sync(last):
            with self.stepper.autocast():
                loss = F.cross_entropy(self.model.train(x), y)
            self.stepper.backward(loss, group.size(b))
        if last:
            opt_step = group.optimizer_step(self.pos.epoch, b)
            self.stepper.step(self.model.bare.parameters, opt_step, self.total_opt_steps)
        self.meter.add(loss.detach())
        return last

    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Inside an accumulation group, gradients stay local until its last batch."""
        if self.plan.mode == "fsdp":  # the root FSDP module, even under torch.compile
            return gradient_sync(self.model.bare, enabled=last)
        no_sync = getattr(self.model.train, "no_sync", None)
        return contextlib.nullcontext() if last or no_sync is None else no_sync()

    def _save_due(self) -> bool:
        every = self.hp.checkpoint_every_s
        return every is not None and time.monotonic() - self.last_save_at >= every

    def _end_epoch(self, summary: dict[str, Any]) -> None:
        val_loss, val_accuracy = self._validate()
        self._publish({**summary, "val_loss": val_loss, "val_accuracy": val_accuracy})
        self.last_metrics = {"val_loss": val_loss, "val_accuracy": val_accuracy, "loss": summary.get("loss")}
        if self.pos.epoch % self.hp.checkpoint_every == 0 or self.pos.epoch == self.hp.epochs:
            self._save()

    def _preempt(self) -> None:
        log(self.ctx.rank, f"SIGTERM: stopped after step {self.pos.step}; saving and exiting")
        self._save()
        if self.saver is not None:
            self.saver.wait()  # the folder is complete before the exit
        raise Preempted

    @torch.no_grad()
    def _validate(self) -> tuple[float | None, float | None]:
        """Loss and accuracy over the whole validation set: each rank a shard, counts summed."""
        if self.val_loader is None:
            return None, None
        self.model.eval.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        sharded = self.plan.mode == "fsdp" and self.ctx.distributed
        behind = forwards_behind(len(self.val_loader), self.ctx.cpu_group) if sharded else 0
        for x, y in self.val_loader:
            x, y = x.to(self.ctx.device), y.to(self.ctx.device)
            out = self.model.eval(x)
            totals[0] += F.cross_entropy(out, y, reduction="sum").double()
            totals[1] += (out.argmax(dim=1) == y).sum()
            totals[2] += y.numel()
        pad_forwards(self.model.eval, self.probe, behind)  # fsdp: as many forwards as every rank
        loss_sum, correct, count = all_reduce_sum(self.ctx, totals).tolist()
        return (loss_sum / count, correct / count) if count else (None, None)

    # ---------------------------------------------------------------- reporting and saving

    def _summarise(self, window: dict[str, Any]) -> dict[str, Any]:
        """Progress fields for a window of steps; resets the in-epoch window.

        Every rank calls it at the same step: the loss is reduced over all ranks (the `.item()`
        also waits for the device, so the time is right on CUDA too), and the throughput is
        global, each rank having processed `batch_size` samples per step.
        """
        steps = window["steps"]
        loss_sum = all_reduce_sum(self.ctx, window["loss"].clone()).item()
        seconds = max(time.perf_counter() - window["t0"], 1e-9)
        self.meter.reset_window()
        return {
            "epoch": self.pos.epoch,
            "epochs": self.hp.epochs,
            "step": self.pos.step,
            "total_steps": self.total_steps,
            "loss": loss_sum / (steps * self.ctx.world_size) if steps else None,
            "samples_per_sec": steps * self.hp.batch_size * self.ctx.world_size / seconds,
        }

    def _publish(self, fields: dict[str, Any]) -> None:
        """Rank 0 alone reports; epoch ends also go to the log."""
        if not self.ctx.is_main:
            return
        report(**fields)
        if "val_loss" in fields:
            log(self.ctx.rank, " ".join(f"{k}={_fmt(v)}" for k, v in fields.items()))

    def _save(self) -> None:
        """Rank 0 alone writes (one writer per job, not per node); all ranks wait for it."""
        if self.env.checkpoint_dir is None or self.pos.step == self.saved_step:
            return
        rng = gather_to_main(self.ctx, capture_rng(cuda=self.plan.is_cuda))
        if self.saver is not None:
            self._save_folder(self.env.checkpoint_dir, self.saver, rng)
        elif self.ctx.is_main:
            path = self.env.checkpoint_dir / checkpoint_name(
                self.pos.epoch,
                self.pos.step,
                mid_epoch=self.pos.batch != 0,
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            # Told before the rename, so the platform knows epoch, step and metrics of the
            # file the moment it appears under its final name.
            report(
                type="checkpoint",
                file=path.name,
                epoch=self.pos.epoch,
                step=self.pos.step,
                metrics=getattr(self, "last_metrics", {}),
            )
            write_atomic(self._checkpoint(rng), path)
            log(self.ctx.rank, f"checkpoint {path}")
        barrier(self.ctx)
        self.saved_step = self.pos.step
        self.last_save_at = time.monotonic()

    def _save_folder(self, directory: Path, saver: DcpSaver, rng: list[Any] | None) -> None:
        """fsdp: every rank writes its shards into one DCP folder, in the background once they
        are staged (a SIGTERM's save is waited for by `_preempt`). Rank 0 first announces it and
        writes `torchjobs.pt` (position, meta, RNG), before DCP's `.metadata` can exist."""
        name = folder_name(self.pos.epoch, self.pos.step, mid_epoch=self.pos.batch != 0)
        folder = directory / name
        started = time.perf_counter()
        saver.wait()  # the previous folder is complete first: folders appear in order
        if self.env.local_rank == 0:  # each node's own folder
            remove_stale_folder(folder)
        barrier(self.ctx)
        if self.ctx.is_main:
            report(
                type="checkpoint",
                file=name,
                epoch=self.pos.epoch,
                step=self.pos.step,
                metrics=getattr(self, "last_metrics", {}),
            )
            write_trainer_state(folder, epoch=self.pos.epoch, step=self.pos.step, meta=self._meta(rng))
        saver.save(folder, self.model.bare, self.optimizer)
        held = time.perf_counter() - started
        self._debug_full_state(name)
        if self.ctx.is_main:
            how = "written" if saver.blocking else "staged; writing in the background"
            log(self.ctx.rank, f"checkpoint {folder} ({how}; training held {held:.3f} s)")

    def _meta(self, rng: list[Any] | None) -> dict[str, Any]:
        meta = {
            "mode": self.plan.mode,
            "world_size": self.ctx.world_size,
            "accelerator": self.plan.accelerator,
            "hyperparameters": self.hp.as_dict(),
            "entrypoint": self.config.entrypoint.as_dict(),
            "torchjobs_version": torchjobs_version(),
            "job_id": self.env.job_id,
            "batch_in_epoch": self.pos.batch,
            "rng": {"ranks": rng},
        }
        scaler = self.stepper.state()
        if scaler is not None:
            meta["grad_scaler"] = scaler
        return meta

    def _checkpoint(self, rng: list[Any] | None) -> dict[str, Any]:
        meta = self._meta(rng)
        return build_checkpoint(
            net_state=unwrap_model(self.model.bare).state_dict(),
            optimizer_state=self.optimizer.state_dict(),
            epoch=self.pos.epoch,
            step=self.pos.step,
            meta=meta,
        )


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
