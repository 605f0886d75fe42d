"""The builtin trainer in `single` mode under torchrun: resume exactness, the checkpoint file,
progress events, preemption, and the failures a user can cause."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.runtime import PREEMPTED_EXIT_CODE
from workers.runtime.checkpoint import load_checkpoint
from workers.runtime.errors import FactoryError
from workers.runtime.preemption import ParentWatchdog, PreemptionFlag
from workers.runtime.trainer.config import Entrypoint, Hyperparameters
from workers.runtime.trainer.factory import load_datasets, load_model
from workers.runtime.trainer.models import build_cnn

PROGRESS_KEYS = {"type", "ts", "epoch", "epochs", "step", "total_steps", "loss", "samples_per_sec"}
EPOCH_END_KEYS = PROGRESS_KEYS | {"val_loss", "val_accuracy"}


@pytest.fixture(scope="module")
def single(jobs: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """4 epochs straight; 2 epochs; then 4 resumed from the 2-epoch checkpoint."""
    root = tmp_path_factory.mktemp("single")
    straight = jobs.start(root / "straight", jobs.config("single"))
    short = jobs.start(root / "short", jobs.config("single", epochs=2))
    straight.ok(), short.ok()
    resumed = jobs.start(
        root / "resumed", jobs.config("single"), resume=short.checkpoints / "epoch-0002.pt"
    ).ok()
    return {"straight": straight, "short": short, "resumed": resumed}


def test_two_epochs_then_two_more_equal_four_straight_bitwise(jobs: Any, single: dict[str, Any]) -> None:
    a = torch.load(single["straight"].checkpoints / "epoch-0004.pt", weights_only=True)
    b = torch.load(single["resumed"].checkpoints / "epoch-0004.pt", weights_only=True)
    jobs.assert_same_weights(a["state_dict"]["net"], b["state_dict"]["net"])  # torch.equal on every tensor
    for pid, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][pid][key]), (pid, key)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (4, 64)
    # the resumed run trained epochs 3 and 4 only
    assert sorted(p.name for p in single["resumed"].checkpoints.iterdir()) == [
        "epoch-0003.pt",
        "epoch-0004.pt",
    ]


def test_checkpoint_has_the_contract_layout(single: dict[str, Any]) -> None:
    run = single["straight"]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == [f"epoch-{e:04d}.pt" for e in range(1, 5)]
    ckpt = torch.load(run.checkpoints / "epoch-0002.pt", weights_only=True)
    assert set(ckpt) == {"state_dict", "optimizer", "epoch", "step", "meta"}
    assert set(ckpt["state_dict"]) == {"net"}
    assert set(ckpt["state_dict"]["net"]) == set(build_cnn().state_dict())
    assert not any(k.startswith("module.") for k in ckpt["state_dict"]["net"])
    assert {"state", "param_groups"} <= set(ckpt["optimizer"])
    assert (ckpt["epoch"], ckpt["step"]) == (2, 32)
    meta = ckpt["meta"]
    assert {"mode", "world_size", "hyperparameters", "torchjobs_version", "rng"} <= set(meta)
    assert (meta["mode"], meta["world_size"], meta["hyperparameters"]["batch_size"]) == ("single", 1, 32)
    assert len(meta["rng"]["ranks"]) == 1


def test_progress_events_from_rank_zero_at_a_bounded_rate(single: dict[str, Any]) -> None:
    events = single["straight"].events()
    # every 4 steps inside an epoch (16 steps each) plus one at each epoch's end
    assert len(events) == 4 * (3 + 1)
    for event in events:
        assert event["type"] == "progress"
        assert set(event) >= PROGRESS_KEYS
        assert event["epochs"] == 4 and event["total_steps"] == 64
        assert event["samples_per_sec"] > 0 and event["loss"] > 0
    ends = [e for e in events if "val_loss" in e]
    assert [e["epoch"] for e in ends] == [1, 2, 3, 4]
    assert [e["step"] for e in ends] == [16, 32, 48, 64]
    assert all(set(e) >= EPOCH_END_KEYS and 0 <= e["val_accuracy"] <= 1 for e in ends)
    steps = [e["step"] for e in events]
    assert steps == sorted(steps)


def test_a_resumed_job_reports_completed_epochs(single: dict[str, Any]) -> None:
    events = single["resumed"].events()
    assert events[0]["epoch"] == 2 and events[0]["step"] == 36
    assert [e["epoch"] for e in events if "val_loss" in e] == [3, 4]


def test_the_seeds_loading_code_loads_our_checkpoint(single: dict[str, Any]) -> None:
    path = single["straight"].checkpoints / "epoch-0004.pt"
    # single-GPU seed code, verbatim but for .cuda()
    net = build_cnn()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-6, weight_decay=1e-3)
    checkpoint = torch.load(path)
    net.load_state_dict(checkpoint["state_dict"]["net"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    # the seed's DDP code: strip "module." with k[7:]
    from collections import OrderedDict

    checkpoint = torch.load(path)["state_dict"]["net"]
    new_state_dict = OrderedDict()
    for k, v in checkpoint.items():
        if "module" in k:
            k = k[7:]
        new_state_dict[k] = v
    net2 = build_cnn()
    net2.load_state_dict(new_state_dict)
    for (name, a), b in zip(net.state_dict().items(), net2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_validator_cli_summarises_a_checkpoint(jobs: Any, single: dict[str, Any]) -> None:
    import json
    import subprocess
    import sys

    path = single["straight"].checkpoints / "epoch-0003.pt"
    out = subprocess.run(
        [sys.executable, "-m", "workers.runtime.checkpoint", str(path)],
        env=jobs.child_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads(out.stdout)
    assert (summary["epoch"], summary["step"], summary["has_optimizer"]) == (3, 48, True)
    assert summary["meta"]["mode"] == "single" and "rng" not in summary["meta"]


# ------------------------------------------------------------------------------------------ SIGTERM

LONG = {"epochs": 3, "batch_size": 16, "synthetic_size": 4096, "report_every": 1, "checkpoint_every": 1}


@pytest.fixture(scope="module")
def preempted_single(jobs: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A long single run stopped by SIGTERM a few steps in, then resumed; and the same straight.

    The preempted rank runs as a plain process (no torchrun) so that its own exit code is seen.
    """
    root = tmp_path_factory.mktemp("preempt-single")
    config = jobs.config("single", **LONG)
    straight = jobs.start(root / "straight", config)
    victim = jobs.start(root / "victim", config, torchrun=False)
    victim.wait_for_event(lambda e: e["step"] >= 5)
    os.killpg(victim.proc.pid, signal.SIGTERM)
    victim.wait(timeout=60)
    resumed = jobs.start(root / "resumed", config, resume=victim.latest_checkpoint()).ok()
    return {"straight": straight.ok(), "victim": victim, "resumed": resumed}


def test_sigterm_finishes_the_step_saves_and_exits_75(preempted_single: dict[str, Any]) -> None:
    victim = preempted_single["victim"]
    assert victim.returncode == PREEMPTED_EXIT_CODE, victim.output[-3000:]
    net, opt, epoch, step, meta = load_checkpoint(victim.latest_checkpoint())
    assert opt is not None and 5 <= step < 3 * 256
    assert meta["batch_in_epoch"] == step - 256 * epoch
    assert f"stopped after step {step}" in victim.output
    assert not list(victim.checkpoints.glob("*.tmp"))


def test_resume_from_a_mid_epoch_checkpoint_is_bitwise_exact(
    jobs: Any, preempted_single: dict[str, Any]
) -> None:
    jobs.assert_same_weights(
        jobs.final_weights(preempted_single["straight"]),
        jobs.final_weights(preempted_single["resumed"]),
    )
    first = preempted_single["resumed"].events()[0]
    _, _, epoch, step, _ = load_checkpoint(preempted_single["victim"].latest_checkpoint())
    assert (first["epoch"], first["step"]) == (epoch, step + 1)


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: an orphan's reaper may be slow or absent in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_rank_whose_torchrun_is_killed_saves_and_exits(jobs: Any, tmp_path: Path) -> None:
    """torchrun starts ranks in sessions of their own, so SIGKILL to torchrun leaves them orphaned;
    the rank notices, stops as after a SIGTERM, and is gone well before anyone would notice."""
    run = jobs.start(tmp_path / "orphan", jobs.config("single", **LONG, num_workers=1))
    run.wait_for_event(lambda e: e["step"] >= 3)
    (rank,) = _children(run.proc.pid)
    os.kill(run.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not _gone(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(rank)
    output = run.wait(timeout=30).output
    assert "is gone: stopping" in output and "SIGTERM: stopped after step" in output
    _, _, epoch, step, meta = load_checkpoint(run.latest_checkpoint())
    assert 3 <= step < 3 * 256 and meta["batch_in_epoch"] == step - 256 * epoch


def test_the_parent_watchdog_stops_then_exits_hard() -> None:
    parents = iter([100, 100, 100, 1])
    exits: list[int] = []
    flag = PreemptionFlag()
    dog = ParentWatchdog(
        flag, grace_s=0.05, poll_s=0.001, getppid=lambda: next(parents, 1), hard_exit=exits.append
    )
    assert not flag.requested
    dog._watch()  # what the thread runs, here in the foreground
    assert flag.requested and exits == [PREEMPTED_EXIT_CODE]


# ------------------------------------------------------------------------------------------ failures


def _write_factory(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "userfactory.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from torch.utils.data import TensorDataset\n"
        "def model():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(),\n"
        "                         nn.Dropout(0.2), nn.Linear(16, 10))\n"
        "def data():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x = torch.rand(96, 1, 8, 8, generator=g)\n"
        "    return TensorDataset(x, torch.randint(0, 10, (96,), generator=g))\n"
        "def broken():\n"
        "    raise RuntimeError('no data today')\n"
        "def number():\n"
        "    return 3\n"
    )


def test_a_factory_entrypoint_trains(jobs: Any, tmp_path: Path) -> None:
    _write_factory(tmp_path / "pkg")
    config = jobs.config("single", epochs=2, batch_size=16)
    config["entrypoint"] = {"kind": "factory", "model": "userfactory:model", "dataset": "userfactory:data"}
    run = jobs.start(tmp_path / "run", config, PYTHONPATH=str(tmp_path / "pkg")).ok()
    ends = [e for e in run.events() if e["epoch"] == 2 and e["step"] == 12]
    assert ends and ends[-1]["val_loss"] is None  # a single dataset: no validation
    net, *_ = load_checkpoint(run.checkpoints / "epoch-0002.pt")
    assert "5.weight" in net and "2.running_var" in net


def test_a_bad_factory_fails_with_a_clear_message_in_torchruns_summary(jobs: Any, tmp_path: Path) -> None:
    """The message reaches torchrun's root-cause summary through the error file @record writes."""
    config = jobs.config("single")
    config["entrypoint"] = {"kind": "factory", "model": "nosuchmodule:model", "dataset": "nosuchmodule:data"}
    run = jobs.start(tmp_path / "run", config).wait()
    assert run.returncode == 1
    assert "model factory 'nosuchmodule:model': cannot import 'nosuchmodule'" in run.output
    assert "Root Cause" in run.output and not run.checkpoints.exists()


@pytest.mark.parametrize(
    ("model", "dataset", "message"),
    [
        (
            "userfactory:nothing",
            "userfactory:data",
            "model factory 'userfactory:nothing': 'userfactory' has no attribute 'nothing'",
        ),
        (
            "userfactory:data",
            "userfactory:data",
            "model factory 'userfactory:data' returned TensorDataset, not an nn.Module",
        ),
        (
            "userfactory:model",
            "userfactory:broken",
            "dataset factory 'userfactory:broken' raised RuntimeError('no data today')",
        ),
        (
            "userfactory:model",
            "userfactory:number",
            "the train dataset (int) is not a map-style dataset",
        ),
    ],
)
def test_bad_factories_are_named_in_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, dataset: str, message: str
) -> None:
    _write_factory(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = Entrypoint(kind="factory", model=model, dataset=dataset)
    with pytest.raises(FactoryError) as err:
        _model_then_datasets(entry)
    assert message in str(err.value)


def _model_then_datasets(entry: Entrypoint) -> None:
    """What the trainer loads from factories, in its order: the model, then the datasets."""
    load_model(entry)
    load_datasets(entry, Hyperparameters())


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_resume_checkpoint_that_would_run_code_is_refused(jobs: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"state_dict": {"net": build_cnn().state_dict()}, "payload": _Evil(marker)}, evil)
    run = jobs.start(tmp_path / "run", jobs.config("single"), resume=evil, torchrun=False).wait()
    assert run.returncode != 0
    assert "refused" in run.output and "weights_only=True" in run.output
    assert not marker.exists()
    assert not run.checkpoints.exists() and not run.events_path.exists()


def test_a_checkpoint_that_does_not_fit_the_model_is_a_clear_error(jobs: Any, tmp_path: Path) -> None:
    bad = tmp_path / "mlp.pt"
    from workers.runtime.trainer.models import build_mlp

    torch.save(build_mlp().state_dict(), bad)
    run = jobs.start(tmp_path / "run", jobs.config("single"), resume=bad, torchrun=False).wait()
    assert run.returncode != 0
    assert "checkpoint weights do not fit the model" in run.output
