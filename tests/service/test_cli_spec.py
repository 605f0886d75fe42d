"""`torchjobs submit FILE.yaml`: what people write in YAML reaches the API as they meant it."""

from __future__ import annotations

from pathlib import Path

from service.client.spec import build_spec
from service.jobs.spec import JobSpec


def test_exponent_floats_and_numeric_env_values_pass_the_strict_spec(tmp_path: Path) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        "mode: ddp\n"
        "gpus_per_node: 2\n"
        "hyperparameters:\n"
        "  lr: 1e-3\n"
        "  weight_decay: 5E-4\n"
        "  epochs: 3\n"
        "env:\n"
        "  OMP_NUM_THREADS: 1\n"
        "  NCCL_DEBUG: INFO\n"
        "  SOME_FLAG: true\n"
        "  NOT_A_NUMBER: '1e-3'\n"
    )
    spec = build_spec(spec_file, ["hyperparameters.lr=2e-4"], {"name": "yaml-job"})
    assert spec["hyperparameters"]["lr"] == 0.0002  # the --set override, parsed the same way
    assert spec["hyperparameters"]["weight_decay"] == 0.0005
    assert spec["hyperparameters"]["epochs"] == 3  # integers stay integers
    expected_env = {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "INFO", "SOME_FLAG": "true", "NOT_A_NUMBER": "1e-3"}
    assert spec["env"] == expected_env
    parsed = JobSpec.model_validate(spec)
    assert parsed.hyperparameters is not None and parsed.hyperparameters.lr == 0.0002


def test_a_scripts_numeric_args_and_labels_reach_the_api_as_text(tmp_path: Path) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        "mode: single\n"
        "entrypoint:\n"
        "  kind: script\n"
        "  path: train.py\n"
        "  args: [--epochs, 2, --lr, 0.1, --amp, true]\n"
        "labels:\n"
        "  version: 2\n"
        "  team: vision\n"
    )
    spec = build_spec(spec_file, [], {})
    assert spec["entrypoint"]["args"] == ["--epochs", "2", "--lr", "0.1", "--amp", "true"]
    assert spec["labels"] == {"version": "2", "team": "vision"}
    JobSpec.model_validate(spec)  # the strict spec takes it
