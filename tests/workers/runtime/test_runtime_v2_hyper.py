"""The v2 trainer hyperparameters (contract §3): lr_schedule with warmup_steps, grad_accum_steps,
clip_grad_norm, amp, compile and checkpoint_every_s; each resumed exactly on the CPU."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from workers.runtime.trainer.stepping import Grouping, lr_factor

V2 = {"lr_schedule": "cosine", "warmup_steps": 3, "grad_accum_steps": 2, "clip_grad_norm": 0.5}


def test_lr_factor() -> None:
    assert [lr_factor(s, 10, "constant", 0) for s in (0, 9)] == [1.0, 1.0]
    assert [lr_factor(s, 10, "constant", 4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert [lr_factor(s, 100, "step", 0) for s in (0, 49, 50, 74, 75, 99)] == [
        1.0,
        1.0,
        0.1,
        0.1,
        0.1**2,
        0.1**2,
    ]
    assert lr_factor(0, 100, "cosine", 0) == 1.0
    assert math.isclose(lr_factor(50, 100, "cosine", 0), 0.5)
    assert lr_factor(2, 102, "cosine", 2) == 1.0 and lr_factor(101, 102, "cosine", 2) < 0.001


def test_grouping_never_straddles_an_epoch() -> None:
    g = Grouping(per_epoch=5, accum=2)
    assert g.groups_per_epoch == 3
    assert [g.is_last(b) for b in range(5)] == [False, True, False, True, True]
    assert [g.size(b) for b in range(5)] == [2, 2, 2, 2, 1]
    assert [g.optimizer_step(1, b) for b in range(5)] == [3, 3, 4, 4, 5]


@pytest.fixture(scope="module")
def v2_runs(jobs: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 epochs straight, then the same job resumed from its own epoch-1 checkpoint (the
    schedule spans the job's whole length, so the first part must be that job's)."""
    root = tmp_path_factory.mktemp("v2")
    runs = {}
    for name, extra in (("v2", V2), ("bf16", {"amp": "bf16"})):
        config = jobs.config("single", epochs=2, **extra)
        straight = jobs.start(root / f"{name}-straight", config).ok()
        resumed = jobs.start(
            root / f"{name}-resumed", config, resume=straight.checkpoints / "epoch-0001.pt"
        ).ok()
        runs[name] = (straight, resumed)
    return runs


@pytest.mark.parametrize("name", ["v2", "bf16"])
def test_resumed_equals_straight_bitwise(jobs: Any, v2_runs: dict[str, Any], name: str) -> None:
    straight, resumed = v2_runs[name]
    a = torch.load(straight.checkpoints / "epoch-0002.pt", weights_only=True)
    b = torch.load(resumed.checkpoints / "epoch-0002.pt", weights_only=True)
    jobs.assert_same_weights(a["state_dict"]["net"], b["state_dict"]["net"])
    assert a["optimizer"]["param_groups"][0]["lr"] == b["optimizer"]["param_groups"][0]["lr"]
    assert a["meta"]["hyperparameters"] == b["meta"]["hyperparameters"]


def test_the_schedule_and_accumulation_shape_the_optimizer(v2_runs: dict[str, Any]) -> None:
    straight, _ = v2_runs["v2"]
    ckpt = torch.load(straight.checkpoints / "epoch-0002.pt", weights_only=True)
    # 16 batches an epoch, 2 per optimizer step: 16 AdamW steps over 2 epochs, not 32
    assert int(ckpt["optimizer"]["state"][0]["step"]) == 16
    expected = (
        0.01 * 0.5 * (1 + math.cos(math.pi * (15 - 3) / (16 - 3)))
    )  # the last step, cosine after warm-up
    assert math.isclose(ckpt["optimizer"]["param_groups"][0]["lr"], expected)
    assert ckpt["step"] == 32  # progress counts batches


def test_checkpoint_every_s_saves_between_optimizer_steps(jobs: Any, tmp_path: Any) -> None:
    run = jobs.start(
        tmp_path / "timed", jobs.config("single", epochs=1, grad_accum_steps=2, checkpoint_every_s=0.001)
    ).ok()
    mid = sorted(p for p in run.checkpoints.iterdir() if "-step-" in p.name)
    assert mid, "no mid-epoch checkpoint"
    for path in mid:
        meta = torch.load(path, weights_only=True)["meta"]
        assert meta["batch_in_epoch"] % 2 == 0  # never inside an accumulation group


def test_fp16_needs_cuda(jobs: Any, tmp_path: Any) -> None:
    run = jobs.start(tmp_path / "fp16", jobs.config("single", epochs=1, amp="fp16")).wait()
    assert run.returncode != 0 and "fp16 needs a CUDA worker" in run.output


def test_compile_trains_and_saves_plain_names(jobs: Any, tmp_path: Any) -> None:
    run = jobs.start(tmp_path / "compiled", jobs.config("single", epochs=1, compile=True)).ok()
    net = torch.load(run.checkpoints / "epoch-0001.pt", weights_only=True)["state_dict"]["net"]
    assert net and not any("_orig_mod" in k for k in net)


def test_ddp_accumulates_without_syncing_inside_a_group(jobs: Any, tmp_path: Any) -> None:
    """DDP skips the all-reduce on all but the last batch of a group (no_sync); bf16 autocast
    goes through the CPU's own synchronised BatchNorm."""
    config = jobs.config("ddp", epochs=1, grad_accum_steps=2, clip_grad_norm=1.0, amp="bf16")
    config["gpus_per_node"] = 2
    run = jobs.start(tmp_path / "ddp", config, nproc=2).ok()
    ckpt = torch.load(run.checkpoints / "epoch-0001.pt", weights_only=True)
    assert int(ckpt["optimizer"]["state"][0]["step"]) == 4  # 8 batches a rank, 2 per step


def test_a_global_batch_is_kept_at_every_world_size() -> None:
    """Contract §12: an elastic job resized keeps its global batch: per-rank batch times
    accumulation times ranks, the fewest accumulation steps whose micro-batch fits `batch_size`."""
    from workers.runtime.errors import ConfigError
    from workers.runtime.trainer.config import Hyperparameters

    hp = Hyperparameters(batch_size=32, global_batch_size=96)
    for world, (batch, accum) in {1: (32, 3), 2: (24, 2), 3: (32, 1), 4: (24, 1), 6: (16, 1)}.items():
        fitted = hp.for_world(world)
        assert (fitted.batch_size, fitted.grad_accum_steps) == (batch, accum), world
        assert fitted.batch_size * fitted.grad_accum_steps * world == 96
    assert Hyperparameters(batch_size=32).for_world(3).batch_size == 32  # without it: per rank
    with pytest.raises(ConfigError, match="does not divide over 5 ranks"):
        hp.for_world(5)
