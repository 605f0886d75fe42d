"""The TensorBoard event files `torchjobs tensorboard` writes (torch's SummaryWriter), read back
by TensorBoard's own reader (`EventAccumulator`), and a run folder per job named by its sweep
point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from service.client.metric_commands import run_name, series_columns, unique_folder, write_run


def read_back(folder: Path) -> dict[str, list[tuple[float, int, float]]]:
    """{tag: [(wall_time, step, value)...]} as TensorBoard reads the run."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_run_reads_back(tmp_path: Path) -> None:
    series: list[dict[str, Any]] = [
        {"step": 10, "epoch": 0, "ts": "2026-12-04T10:00:00+00:00", "loss": 2.5},
        {"step": 20, "epoch": 1, "ts": "2026-12-04T10:00:01+00:00", "loss": 1.25, "val_loss": 1.5},
        {"step": None, "epoch": 1, "ts": "2026-12-04T10:00:02+00:00", "bleu": 30.0, "flag": True},
    ]
    assert write_run(tmp_path / "run", series) == 3
    (path,) = list((tmp_path / "run").iterdir())
    assert path.name.startswith("events.out.tfevents.")
    got = read_back(tmp_path / "run")
    assert got == {
        "loss": [(1796378400.0, 10, 2.5), (1796378401.0, 20, 1.25)],
        "val_loss": [(1796378401.0, 20, 1.5)],
        "bleu": [(1796378402.0, 2, 30.0)],  # no step: its place in the series
    }


def test_an_empty_run_and_a_negative_step(tmp_path: Path) -> None:
    assert write_run(tmp_path / "empty", []) == 0
    assert read_back(tmp_path / "empty") == {}
    write_run(tmp_path / "neg", [{"step": -1, "epoch": None, "ts": "nonsense", "x": 1}])
    assert read_back(tmp_path / "neg") == {"x": [(0.0, -1, 1.0)]}


def test_without_tensorboard_the_command_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    import typer

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # an import that fails
    with pytest.raises(typer.Exit) as exit_info:
        write_run(tmp_path / "run", [{"step": 1, "loss": 1.0}])
    assert exit_info.value.exit_code == 2


def test_run_names_and_columns() -> None:
    child = {"id": 7, "name": None, "sweep_point": {"hyperparameters.lr": 0.01, "hyperparameters.seed": 0}}
    assert run_name(child) == "lr=0.01,seed=0"
    assert run_name({"id": 3, "name": "a/b c", "sweep_point": None}) == "job-3-a_b_c"
    assert run_name({"id": 4, "sweep_point": {"x": "../.."}}) == "x=.._"  # never "..", never a hidden folder
    used: set[str] = set()
    assert [unique_folder("a", 1, used), unique_folder("a", 2, used)] == ["a", "a-job2"]
    got = {"names": ["loss", "val_loss"]}
    assert series_columns(got, None) == ["loss", "val_loss"]
    assert series_columns(got, "val_loss,nope,loss,val_loss") == ["val_loss", "loss"]
