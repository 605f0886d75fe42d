"""The job spec alone: contradictions name their field (no database, no server)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from service.jobs.spec import JobSpec

BUILTIN = {"kind": "builtin", "model": "cnn", "dataset": "digits"}


def loc_of(spec: dict) -> tuple:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(spec)
    return info.value.errors()[0]["loc"]


@pytest.mark.parametrize(
    ("spec", "loc"),
    [
        ({"mode": "single", "entrypoint": BUILTIN, "bogus": 1}, ("bogus",)),
        ({"mode": "single", "gpus_per_node": 2, "entrypoint": BUILTIN}, ("gpus_per_node",)),
        ({"mode": "dp", "nodes": 2, "entrypoint": BUILTIN}, ("nodes",)),
        (
            {"mode": "single", "entrypoint": BUILTIN, "hyperparameters": {"epochs": 0}},
            ("hyperparameters", "epochs"),
        ),
        (
            {"mode": "single", "entrypoint": {"kind": "builtin", "model": "resnet"}},
            ("entrypoint", "builtin", "model"),
        ),
        ({"mode": "ddp", "entrypoint": BUILTIN, "env": {"MASTER_PORT": "1"}}, ("env",)),
        ({"mode": "ddp", "entrypoint": BUILTIN, "env": {"LD_PRELOAD": "/x.so"}}, ("env",)),
        ({"mode": "ddp", "entrypoint": BUILTIN, "resume_from": {}}, ("resume_from",)),
        (
            {"mode": "single", "entrypoint": {"kind": "script", "path": "a.py"}, "hyperparameters": {}},
            ("hyperparameters",),
        ),
        (
            {"mode": "single", "entrypoint": {"kind": "factory", "model": "os.system", "dataset": "x:y"}},
            ("entrypoint", "factory", "model"),
        ),
    ],
)
def test_contradictions_name_their_field(spec: dict, loc: tuple) -> None:
    assert loc_of(spec) == loc


def test_defaults_fill_the_hyperparameters() -> None:
    spec = JobSpec.model_validate({"mode": "ddp", "gpus_per_node": 2, "entrypoint": BUILTIN})
    hp = spec.effective_hyperparameters()
    assert hp is not None and hp.epochs == 10 and hp.batch_size == 64 and hp.optimizer == "adamw"


@given(
    mode=st.sampled_from(["single", "dp", "ddp"]),
    nodes=st.integers(min_value=-3, max_value=70),
    gpus=st.integers(min_value=-3, max_value=70),
)
def test_valid_specs_are_exactly_the_consistent_ones(mode: str, nodes: int, gpus: int) -> None:
    spec = {"mode": mode, "nodes": nodes, "gpus_per_node": gpus, "entrypoint": BUILTIN}
    consistent = 1 <= nodes <= 64 and 1 <= gpus <= 64
    consistent &= not (mode in ("single", "dp") and nodes > 1)
    consistent &= not (mode == "single" and gpus != 1)
    try:
        JobSpec.model_validate(spec)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted == consistent
