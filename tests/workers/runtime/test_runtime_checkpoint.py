"""`load_checkpoint` on every accepted layout, on what it must refuse, and the atomic writer."""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from workers.runtime import checkpoint as ckpt_mod
from workers.runtime.checkpoint import (
    build_checkpoint,
    fit_state_dict,
    load_checkpoint,
    unwrap_model,
    write_atomic,
)
from workers.runtime.errors import CheckpointError
from workers.runtime.trainer.models import build_cnn, build_mlp


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.rand(4, 1, 8, 8)).sum().backward()
    opt.step()
    return model, opt


def _assert_loads_into_fresh_model(net: dict[str, torch.Tensor], model: nn.Module) -> None:
    fresh = build_mlp()
    fresh.load_state_dict(fit_state_dict(net, fresh))  # strict: every name matches
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_torchjobs_layout_round_trips(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    payload = build_checkpoint(
        net_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        epoch=3,
        step=42,
        meta={"mode": "ddp", "world_size": 2, "rng": {"ranks": [{"torch": torch.get_rng_state()}]}},
    )
    write_atomic(payload, tmp_path / "epoch-0003.pt")
    raw = torch.load(tmp_path / "epoch-0003.pt", weights_only=True)
    assert set(raw) == {"state_dict", "optimizer", "epoch", "step", "meta"}
    net, opt_state, epoch, step, meta = load_checkpoint(tmp_path / "epoch-0003.pt")
    _assert_loads_into_fresh_model(net, model)
    assert opt_state is not None and opt_state["param_groups"] == opt.state_dict()["param_groups"]
    assert (epoch, step, meta["mode"]) == (3, 42, "ddp")
    assert [p.name for p in tmp_path.iterdir()] == ["epoch-0003.pt"]  # no .tmp left behind


def test_seed_single_gpu_layout(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    torch.save({"state_dict": {"net": model.state_dict()}, "optimizer": opt.state_dict()}, tmp_path / "s.pt")
    net, opt_state, epoch, step, meta = load_checkpoint(tmp_path / "s.pt")
    _assert_loads_into_fresh_model(net, model)
    assert opt_state is not None and (epoch, step, meta) == (0, 0, {})


def test_seed_ddp_layout_with_module_prefixes_and_nested_optimizer(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    prefixed = OrderedDict((f"module.{k}", v) for k, v in model.state_dict().items())
    torch.save({"state_dict": {"net": prefixed}, "optimizer": {"net": opt.state_dict()}}, tmp_path / "s.pt")
    net, opt_state, *_ = load_checkpoint(tmp_path / "s.pt")
    _assert_loads_into_fresh_model(net, model)
    assert opt_state is not None and set(opt_state) == {"state", "param_groups"}


def test_a_plain_save_of_a_dataparallel_models_state_dict(tmp_path: Path) -> None:
    model, _ = _model_and_optimizer()
    wrapped = nn.DataParallel(model)  # on a CPU-only machine this just holds the module
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    torch.save(wrapped.state_dict(), tmp_path / "dp.pt")
    net, opt_state, epoch, step, meta = load_checkpoint(tmp_path / "dp.pt")
    _assert_loads_into_fresh_model(net, model)
    assert (opt_state, epoch, step, meta) == (None, 0, 0, {})


@pytest.mark.parametrize("layout", ["bare", "flat_state_dict", "double_prefix"])
def test_other_bare_layouts(tmp_path: Path, layout: str) -> None:
    model, _ = _model_and_optimizer()
    state = model.state_dict()
    obj: Any = {
        "bare": state,
        "flat_state_dict": {"state_dict": state},
        "double_prefix": {f"module.module.{k}": v for k, v in state.items()},
    }[layout]
    torch.save(obj, tmp_path / "c.pt")
    _assert_loads_into_fresh_model(load_checkpoint(tmp_path / "c.pt")[0], model)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("how", ["torch.save", "pickle.dump"])
def test_a_file_that_would_run_code_on_load_is_refused_and_nothing_runs(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "pwned"
    payload = {"state_dict": {"net": build_cnn().state_dict()}, "optimizer": _Evil(marker)}
    path = tmp_path / "evil.pt"
    if how == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=2)
    with pytest.raises(CheckpointError, match=r"refused: .*weights_only=True.*nothing in it ran"):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([1, 2, 3], "expected a dict at the top level"),
        ({"model": {"w": 1}}, "not a state dict of named tensors"),
        ({}, "no weights found"),
        (
            {"state_dict": {"net": {"w": torch.zeros(1)}}, "epoch": -1},
            "'epoch' must be a non-negative integer",
        ),
        (
            {"state_dict": {"net": {"w": torch.zeros(1)}}, "optimizer": {"lr": 1}},
            "not an optimizer state_dict",
        ),
    ],
)
def test_layouts_that_are_not_checkpoints_are_clear_errors(
    tmp_path: Path, content: Any, message: str
) -> None:
    torch.save(content, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "c.pt")


def test_unreadable_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "junk.pt").write_bytes(b"definitely not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt"):
        load_checkpoint(tmp_path / "junk.pt")
    good = tmp_path / "good.pt"
    torch.save(build_cnn().state_dict(), good)
    (tmp_path / "truncated.pt").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(tmp_path / "truncated.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def test_validator_cli_exits_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save([1], tmp_path / "c.pt")
    assert ckpt_mod.main([str(tmp_path / "c.pt")]) == 2
    assert "expected a dict at the top level" in capsys.readouterr().err


def test_write_atomic_replaces_an_existing_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "epoch-0001.pt"
    write_atomic({"a": torch.zeros(3)}, path)
    write_atomic({"a": torch.ones(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-0001.pt"]


# ------------------------------------------------------------------------------------------ wrapper prefixes


class _Ema(nn.Module):
    """The EMA/wrapper pattern: the real model is a submodule called `module`, beside state of
    the wrapper's own."""

    def __init__(self) -> None:
        super().__init__()
        self.module = build_mlp()
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _ema() -> nn.Module:
    torch.manual_seed(0)
    model = _Ema()
    with torch.no_grad():
        model.updates.fill_(7)
    return model


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    assert list(a.state_dict()) == list(b.state_dict())
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name


def test_a_submodule_called_module_keeps_its_names_through_save_and_resume(tmp_path: Path) -> None:
    model = _ema()
    wrapped = torch.compile(nn.DataParallel(model))  # no compilation happens before a forward
    saved = unwrap_model(wrapped).state_dict()
    assert set(saved) == set(model.state_dict()) and "module.1.weight" in saved and "updates" in saved
    payload = build_checkpoint(
        net_state=saved, optimizer_state={"state": {}, "param_groups": []}, epoch=1, step=2, meta={}
    )
    write_atomic(payload, tmp_path / "ema.pt")
    net, *_ = load_checkpoint(tmp_path / "ema.pt")
    assert set(net) == set(model.state_dict())
    fresh = _Ema()
    fresh.load_state_dict(fit_state_dict(net, fresh))
    _assert_same_state(fresh, model)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."])
def test_wrapper_prefixes_are_dropped_where_the_model_lacks_them(tmp_path: Path, prefix: str) -> None:
    """The seed's DDP save (`module.`), a compiled model's (`_orig_mod.`) and both, into a plain
    model; and a DDP save of the EMA wrapper, whose own names begin with `module.`."""
    plain, _ = _model_and_optimizer()
    torch.save(
        {"state_dict": {"net": {prefix + k: v for k, v in plain.state_dict().items()}}}, tmp_path / "p.pt"
    )
    _assert_loads_into_fresh_model(load_checkpoint(tmp_path / "p.pt")[0], plain)

    ema = _ema()
    torch.save({prefix + k: v for k, v in ema.state_dict().items()}, tmp_path / "ema.pt")
    fresh = _Ema()
    fresh.load_state_dict(fit_state_dict(load_checkpoint(tmp_path / "ema.pt")[0], fresh))
    _assert_same_state(fresh, ema)


def test_a_real_compiled_model_state_dict_loads_into_a_plain_one(tmp_path: Path) -> None:
    plain, _ = _model_and_optimizer()
    compiled = torch.compile(plain)
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    torch.save(compiled.state_dict(), tmp_path / "c.pt")
    _assert_loads_into_fresh_model(load_checkpoint(tmp_path / "c.pt")[0], plain)


def test_a_name_both_with_and_without_a_wrapper_prefix_is_a_clear_error() -> None:
    state = {"0.weight": torch.zeros(1), "module.0.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError, match="'0.weight' appears twice"):
        fit_state_dict(state, nn.Sequential(nn.Linear(1, 1, bias=False)))
    # ...unless the model really has both names
    both = nn.Sequential(nn.Linear(1, 1, bias=False))
    both.module = nn.Sequential(nn.Linear(1, 1, bias=False))
    assert set(fit_state_dict(state, both)) == set(state)


EMA_FACTORY = """
from torch import nn
from workers.runtime.trainer.data import builtin_datasets
from workers.runtime.trainer.models import build_mlp

class Ema(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = build_mlp()

    def forward(self, x):
        return self.module(x)

def model():
    return Ema()

def data():
    return builtin_datasets("synthetic", synthetic_size=256)
"""


def test_the_trainer_saves_and_resumes_a_model_with_a_submodule_called_module(
    jobs: Any, tmp_path: Path
) -> None:
    """The trainer used to save `module.1.weight` as `1.weight`, and then could not resume from
    its own checkpoint. Now the names stay, and 1 epoch + resume + 1 equals 2 straight."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "emafactory.py").write_text(EMA_FACTORY)

    def start(name: str, epochs: int, resume: Path | None = None) -> Any:
        config = jobs.config("single", epochs=epochs)
        config["entrypoint"] = {"kind": "factory", "model": "emafactory:model", "dataset": "emafactory:data"}
        return jobs.start(
            tmp_path / name, config, resume=resume, torchrun=False, PYTHONPATH=str(tmp_path / "pkg")
        )

    straight, short = start("straight", 2), start("short", 1)
    straight.ok(), short.ok()
    first = short.checkpoints / "epoch-0001.pt"
    names = set(torch.load(first, weights_only=True)["state_dict"]["net"])
    assert "module.1.weight" in names and not any(n.startswith("1.") for n in names)
    resumed = start("resumed", 2, resume=first).ok()
    assert "resuming at epoch 1" in resumed.output
    jobs.assert_same_weights(jobs.final_weights(straight), jobs.final_weights(resumed))
