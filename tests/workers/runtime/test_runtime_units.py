"""Pure parts of the runtime: environment, config, plan (CUDA paths included, by reading the
plan rather than running it), progress events, data order, optimizer-state fitting."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from workers.runtime import report
from workers.runtime.env import RuntimeEnv, runtime_env
from workers.runtime.errors import ConfigError
from workers.runtime.trainer.config import Hyperparameters, parse_config
from workers.runtime.trainer.data import (
    EpochBatchSampler,
    LoaderOptions,
    builtin_datasets,
    digits_table,
    digits_tensors,
    synthetic_tensors,
    train_loader,
)
from workers.runtime.trainer.distributed import DistContext, StopAgreement, describe_placement
from workers.runtime.trainer.models import build_cnn, build_mlp
from workers.runtime.trainer.parallel import load_optimizer_state, make_optimizer
from workers.runtime.trainer.plan import make_plan

TORCHRUN_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def _config(mode: str = "ddp", **extra: Any) -> dict[str, Any]:
    return {"mode": mode, "entrypoint": {"kind": "builtin", "model": "cnn", "dataset": "digits"}, **extra}


def _entry(kind: str, model: str, dataset: str) -> dict[str, Any]:
    return {"mode": "ddp", "entrypoint": {"kind": kind, "model": model, "dataset": dataset}}


# ------------------------------------------------------------------------------------------ env


def test_env_defaults_describe_a_lone_process() -> None:
    env = RuntimeEnv.from_environ({})
    assert (env.rank, env.local_rank, env.world_size) == (0, 0, 1)
    assert (env.checkpoint_dir, env.events_path, env.resume_from) == (None, None, None)


def test_env_reads_torchrun_and_torchjobs_variables() -> None:
    env = RuntimeEnv.from_environ(
        {
            **TORCHRUN_ENV,
            "TORCHJOBS_JOB_ID": "7",
            "TORCHJOBS_CHECKPOINT_DIR": "/ck",
            "TORCHJOBS_EVENTS": "/ev",
            "TORCHJOBS_RESUME_FROM": "/r.pt",
            "TORCHJOBS_ACCELERATOR": "cuda",
            "TORCHJOBS_DEBUG_DUMP_DIR": "",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.master_addr, env.master_port, env.job_id) == ("10.0.0.1", 29500, "7")
    assert (env.checkpoint_dir, env.events_path, env.resume_from) == (Path("/ck"), Path("/ev"), Path("/r.pt"))
    assert env.accelerator == "cuda" and env.debug_dump_dir is None


@pytest.mark.parametrize(
    "bad", [{"RANK": "x"}, {"RANK": "2", "WORLD_SIZE": "2"}, {"TORCHJOBS_ACCELERATOR": "tpu"}]
)
def test_env_rejects_nonsense(bad: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        RuntimeEnv.from_environ(bad)


# ------------------------------------------------------------------------------------------ config


def test_missing_hyperparameters_take_the_defaults() -> None:
    config = parse_config(_config(hyperparameters={"epochs": 3}))
    assert config.hyperparameters == Hyperparameters(epochs=3)
    assert (config.hyperparameters.batch_size, config.hyperparameters.report_every) == (64, 10)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_config(hyperparameters={"epochz": 3}), "unknown hyperparameters"),
        (_config(hyperparameters={"optimizer": "adam"}), "optimizer must be one of"),
        (_config(hyperparameters={"batch_size": 0}), "batch_size must be an integer >= 1"),
        (_config(hyperparameters={"lr": True}), "lr must be a number"),
        (_config(mode="pipeline"), "mode must be one of"),
        (_config(mode="single", gpus_per_node=2), "does not fit mode 'single'"),
        (_entry("builtin", "resnet", "digits"), "unknown builtin model"),
        (_entry("builtin", "cnn", "cifar"), "unknown builtin dataset"),
        (_entry("factory", "pkg.mod", "a:b"), "module:callable"),
        (_entry("script", "a:b", "a:b"), "kind must be one of"),
        (_config(extra=1), "unknown config keys"),
    ],
)
def test_bad_configs_are_clear_errors(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


# ------------------------------------------------------------------------------------------ plan


def test_ddp_on_cuda_uses_nccl_on_the_local_rank_gpu() -> None:
    plan = make_plan(
        parse_config(_config(accelerator="cuda")), RuntimeEnv.from_environ(TORCHRUN_ENV), cuda_device_count=2
    )
    assert (plan.backend, plan.device, plan.rank, plan.world_size) == ("nccl", "cuda:1", 3, 4)


def test_a_mig_rank_takes_its_own_instance_and_drives_it_as_cuda_0() -> None:
    """CUDA enumerates one MIG instance per process: local rank 1 of `MIG-a,MIG-b` narrows
    CUDA_VISIBLE_DEVICES to `MIG-b` before CUDA starts, and its plan drives `cuda:0` (#37)."""
    from workers.runtime.mig import take_own_device

    environ = {**TORCHRUN_ENV, "CUDA_VISIBLE_DEVICES": "MIG-a,MIG-b", "TORCHJOBS_RANK_DEVICES": "MIG-a,MIG-b"}
    assert environ["LOCAL_RANK"] == "1"
    assert take_own_device(environ) == "MIG-b" and environ["CUDA_VISIBLE_DEVICES"] == "MIG-b"
    env = RuntimeEnv.from_environ(environ)
    plan = make_plan(parse_config(_config(accelerator="cuda")), env, cuda_device_count=1)
    assert (plan.backend, plan.device, plan.local_rank) == ("nccl", "cuda:0", 1)
    plain = {**TORCHRUN_ENV, "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    assert take_own_device(plain) is None and plain["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"


def test_ddp_on_cpu_uses_gloo() -> None:
    plan = make_plan(
        parse_config(_config(accelerator="cpu")), RuntimeEnv.from_environ(TORCHRUN_ENV), cuda_device_count=2
    )
    assert (plan.backend, plan.device) == ("gloo", "cpu")
    assert describe_placement(plan) == "placement: cpu, backend gloo"  # the GPU form: tests/gpu


def test_config_accelerator_wins_over_the_environment() -> None:
    env = RuntimeEnv.from_environ({**TORCHRUN_ENV, "TORCHJOBS_ACCELERATOR": "cuda"})
    assert make_plan(parse_config(_config(accelerator="cpu")), env, cuda_device_count=2).accelerator == "cpu"
    assert make_plan(parse_config(_config()), env, cuda_device_count=2).accelerator == "cuda"


def test_dp_on_cuda_spans_the_nodes_gpus_without_a_process_group() -> None:
    plan = make_plan(
        parse_config(_config(mode="dp", accelerator="cuda", gpus_per_node=2)),
        RuntimeEnv.from_environ({}),
        cuda_device_count=2,
    )
    assert (plan.backend, plan.device, plan.dp_device_ids) == (None, "cuda:0", (0, 1))
    cpu = make_plan(
        parse_config(_config(mode="dp", accelerator="cpu", gpus_per_node=2)),
        RuntimeEnv.from_environ({}),
        cuda_device_count=0,
    )
    assert (cpu.backend, cpu.device, cpu.dp_device_ids) == (None, "cpu", ())


@pytest.mark.parametrize(
    ("config", "environ", "gpus", "message"),
    [
        (_config(accelerator="cuda"), TORCHRUN_ENV, 0, "sees no CUDA device"),
        (_config(mode="single"), TORCHRUN_ENV, 0, "runs one process"),
        (_config(), {}, 0, "must be started by torchrun"),
        (_config(mode="dp", accelerator="cuda", gpus_per_node=4), {}, 2, "wants 4 GPUs"),
    ],
)
def test_impossible_plans_are_clear_errors(
    config: dict[str, Any], environ: dict[str, str], gpus: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        make_plan(parse_config(config), RuntimeEnv.from_environ(environ), cuda_device_count=gpus)


# ------------------------------------------------------------------------------------------ events


@pytest.fixture
def events_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("TORCHJOBS_EVENTS", str(path))
    runtime_env.cache_clear()
    yield path
    runtime_env.cache_clear()


def test_report_appends_one_json_line_per_call(events_file: Path) -> None:
    report(epoch=1, loss=torch.tensor(0.5), samples_per_sec=float("nan"), custom=[1, 2])
    report(type="custom", ts=1.0, note="scripts may send anything")
    first, second = (json.loads(line) for line in events_file.read_text().splitlines())
    assert first["type"] == "progress" and math.isclose(first["ts"], first["ts"])
    assert (first["epoch"], first["loss"], first["custom"]) == (1, 0.5, [1, 2])
    assert first["samples_per_sec"] is None  # NaN is not JSON
    assert (second["type"], second["ts"]) == ("custom", 1.0)


def test_report_without_an_events_file_is_a_no_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TORCHJOBS_EVENTS", raising=False)
    monkeypatch.chdir(tmp_path)
    runtime_env.cache_clear()
    try:
        report(epoch=1)
    finally:
        runtime_env.cache_clear()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ data


def _order(sampler: EpochBatchSampler, epoch: int, skip: int = 0) -> list[list[int]]:
    sampler.set_epoch(epoch, skip_batches=skip)
    return list(sampler)


def test_epoch_order_depends_only_on_seed_and_epoch() -> None:
    train, _ = builtin_datasets("synthetic", synthetic_size=100)
    a = EpochBatchSampler(train, batch_size=8, num_replicas=1, rank=0, seed=5)
    b = EpochBatchSampler(train, batch_size=8, num_replicas=1, rank=0, seed=5)
    history = [_order(a, e) for e in range(3)]
    assert _order(b, 2) == history[2]  # no history needed
    assert history[0] != history[1] != history[2]
    assert len(history[0]) == len(a) == 12 and all(len(batch) == 8 for batch in history[0])


def test_a_mid_epoch_resume_skips_exactly_the_batches_already_trained() -> None:
    train, _ = builtin_datasets("synthetic", synthetic_size=100)
    sampler = EpochBatchSampler(train, batch_size=8, num_replicas=1, rank=0, seed=5)
    full = _order(sampler, 1)
    assert _order(sampler, 1, skip=5) == full[5:] and len(sampler) == 7
    assert _order(sampler, 2) != full and len(sampler) == 12  # the skip lasts one epoch
    with pytest.raises(ValueError, match="cannot skip 13 of 12 batches"):
        sampler.set_epoch(0, skip_batches=13)


def test_replicas_get_disjoint_equal_shards() -> None:
    train, _ = builtin_datasets("synthetic", synthetic_size=100)
    shards = [EpochBatchSampler(train, batch_size=8, num_replicas=2, rank=r, seed=5) for r in (0, 1)]
    got = [{i for batch in _order(s, 3) for i in batch} for s in shards]
    assert not got[0] & got[1] and len(got[0]) == len(got[1]) == 48


def test_digits_are_scaled_and_split_once() -> None:
    x_tr, y_tr, x_va, y_va = digits_tensors()
    assert x_tr.shape == (1438, 1, 8, 8) and x_va.shape == (359, 1, 8, 8)
    assert x_tr.dtype == torch.float32 and float(x_tr.min()) >= 0.0 and float(x_tr.max()) == 1.0
    assert set(y_tr.tolist()) == set(range(10))
    assert digits_tensors() is digits_tensors()  # cached


def test_the_digits_table_is_scikit_learns_data_and_target() -> None:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    table = digits_table()
    assert np.array_equal(table[:, :-1], bunch.data)
    assert np.array_equal(table[:, -1].astype(np.int64), bunch.target)


def test_where_the_file_is_not_in_a_folder_of_the_package_load_digits_reads_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An editable install's spec names a loader, not the package's folder (reviewed: the
    path built from it did not exist and the job failed where `load_digits` works)."""
    import importlib.machinery

    from sklearn.datasets import load_digits

    editable = importlib.machinery.ModuleSpec("sklearn", None, origin=str(tmp_path / "loader.py"))
    editable.submodule_search_locations = [str(tmp_path / "loader.py" / "sklearn")]
    monkeypatch.setattr("workers.runtime.trainer.data.importlib.util.find_spec", lambda name: editable)
    table = digits_table()
    bunch = load_digits()
    assert np.array_equal(table[:, :-1], bunch.data) and np.array_equal(table[:, -1], bunch.target)


def test_digits_are_read_without_importing_scikit_learn() -> None:
    """What the rank's CPU was spent on: the import, not the file (see `digits_table`)."""
    probe = (
        "import sys\n"
        "from workers.runtime.trainer.data import digits_tensors\n"
        "assert digits_tensors()[0].shape[0] == 1438\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_synthetic_data_is_deterministic_and_learnable_shaped() -> None:
    a, b = synthetic_tensors(64), synthetic_tensors.__wrapped__(64)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert a[0].shape == (64, 1, 8, 8) and a[2].shape == (12, 1, 8, 8) and int(a[1].max()) < 10


def test_builtin_models_take_8x8_images_and_give_10_classes() -> None:
    for build in (build_cnn, build_mlp):
        assert build()(torch.rand(4, 1, 8, 8)).shape == (4, 10)


# ------------------------------------------------------------------------------------------ misc


def test_stop_agreement_alone_is_the_local_flag() -> None:
    stop = StopAgreement(DistContext(rank=0, world_size=1, device=torch.device("cpu")))
    assert (stop.after_step(False), stop.after_step(True), stop.settle(False)) == (False, True, False)


def _trained_optimizer(kind: str) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    model = build_mlp()
    opt = make_optimizer(model, Hyperparameters(optimizer=kind, lr=0.5))
    model(torch.rand(4, 1, 8, 8)).sum().backward()
    opt.step()
    return opt, opt.state_dict()


def test_optimizer_state_loads_and_the_jobs_lr_wins() -> None:
    _, saved = _trained_optimizer("adamw")
    fresh = make_optimizer(build_mlp(), Hyperparameters(lr=0.01))
    assert load_optimizer_state(fresh, saved, Hyperparameters(lr=0.01)) is None
    assert fresh.param_groups[0]["lr"] == 0.01 and len(fresh.state) == len(saved["state"])


def test_optimizer_state_that_does_not_fit_is_skipped_with_a_reason() -> None:
    _, sgd_state = _trained_optimizer("sgd")
    adamw = make_optimizer(build_mlp(), Hyperparameters())
    assert "different optimizer" in load_optimizer_state(adamw, sgd_state, Hyperparameters())
    _, saved = _trained_optimizer("adamw")
    cnn_opt = make_optimizer(build_cnn(), Hyperparameters())
    assert "not loaded" in load_optimizer_state(cnn_opt, saved, Hyperparameters())
    assert not cnn_opt.state


def test_the_batched_loader_gives_the_batches_the_per_sample_loader_gives() -> None:
    """The trainer gathers in-memory batches in one indexing operation; the tensors must be
    exactly those of the DataLoader's per-sample fetch and default collate."""
    train, _ = builtin_datasets("digits", synthetic_size=0)

    def batches(loader_of: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        sampler = EpochBatchSampler(train, batch_size=32, num_replicas=2, rank=1, seed=5)
        sampler.set_epoch(3)
        return [tuple(b) for b in loader_of(sampler)]

    opts = LoaderOptions(num_workers=0, pin_memory=False, seed=5)
    fast = batches(lambda s: train_loader(train, s, opts))
    plain = batches(lambda s: torch.utils.data.DataLoader(train, batch_sampler=s))
    assert len(fast) == len(plain) > 0
    for (fx, fy), (px, py) in zip(fast, plain, strict=True):
        assert torch.equal(fx, px) and torch.equal(fy, py) and fx.dtype == px.dtype
