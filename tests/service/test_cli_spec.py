"""`torchjobs submit FILE.yaml`: what people write in YAML reaches the API as they meant it."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from pydantic import ValidationError

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


def test_nodes_take_a_count_or_an_elastic_range() -> None:
    from service.client.job_commands import parse_nodes

    assert parse_nodes("3") == 3
    assert parse_nodes("2:4") == {"min": 2, "max": 4}
    with pytest.raises(typer.BadParameter):
        parse_nodes("2-4")


def test_the_table_says_how_many_attempts_were_preempted_or_resized() -> None:
    from service.client.job_commands import _attempt, _nodes

    attempts = [
        {"attempt": 1, "reason": "resized", "finished_at": "t"},
        {"attempt": 2, "reason": "preempted", "finished_at": "t"},
        {"attempt": 3, "reason": "resized", "finished_at": "t"},
        {"attempt": 4, "reason": None, "finished_at": None},
    ]
    assert _attempt({"attempt": 4, "attempts": attempts}) == "4 (preempted 1, resized 2)"
    assert _attempt({"attempt": 1, "attempts": []}) == "1"
    job = {"nodes": {"min": 2, "max": 4}, "assignments": [{}, {}, {}]}
    assert _nodes(job) == "3 (2:4)" and _nodes({"nodes": 2}) == "2"


ENTRY = {"kind": "builtin", "model": "mlp", "dataset": "synthetic"}


@pytest.mark.parametrize(
    ("spec", "field", "says"),
    [
        ({"mode": "dp", "nodes": {"min": 1, "max": 2}}, "nodes", "only 'ddp' and 'fsdp' may be elastic"),
        ({"mode": "ddp", "nodes": {"min": 3, "max": 2}}, "nodes", "below min"),
        ({"mode": "ddp", "nodes": {"min": 0, "max": 2}}, "nodes", "greater than or equal to 1"),
        ({"mode": "ddp", "nodes": {"min": 1, "max": 2, "step": 1}}, "nodes", "Extra inputs"),
        (
            {"mode": "ddp", "nodes": {"min": 2, "max": 3}, "hyperparameters": {"global_batch_size": 8}},
            "hyperparameters",
            "does not divide over 3 ranks",
        ),
    ],
)
def test_an_elastic_range_that_cannot_work_is_refused_naming_its_field(
    spec: dict[str, object], field: str, says: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate({**spec, "entrypoint": ENTRY})
    errors = caught.value.errors()
    assert all(e["loc"][0] == field for e in errors), errors
    assert any(says in e["msg"] for e in errors), errors


def test_an_elastic_range_and_a_global_batch_that_divides_are_taken() -> None:
    spec = JobSpec.model_validate(
        {
            "mode": "fsdp",
            "nodes": {"min": 2, "max": 3},
            "entrypoint": ENTRY,
            "hyperparameters": {"global_batch_size": 12},
        }
    )
    assert spec.node_range == (2, 3)
