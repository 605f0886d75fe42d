"""The v2 trainer hyperparameters at the API (contract §3): accepted, shown back, each bad
value a 422 naming its field; fp16 refused where no worker has CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.migrate import upgrade
from tests.factories import make_worker

TOKEN = "tj_v2_admin_token_0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
V2 = {
    "lr_schedule": "cosine",
    "warmup_steps": 100,
    "amp": "bf16",
    "grad_accum_steps": 4,
    "clip_grad_norm": 1.0,
    "compile": True,
    "checkpoint_every_s": 600,
}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(home=tmp_path, admin_token=TOKEN)
    upgrade(settings)
    with TestClient(create_app(settings, scheduler=False)) as client:
        yield client


def job(**hyper: object) -> dict[str, object]:
    entry = {"kind": "builtin", "model": "cnn", "dataset": "digits"}
    return {"mode": "single", "entrypoint": entry, "hyperparameters": hyper}


def test_the_v2_knobs_are_accepted_and_shown(api: TestClient) -> None:
    answer = api.post("/v1/jobs", json=job(**V2), headers=ADMIN)
    assert answer.status_code == 201, answer.text
    assert {k: answer.json()["hyperparameters"][k] for k in V2} == V2
    defaults = api.post("/v1/jobs", json=job(), headers=ADMIN).json()["hyperparameters"]
    assert defaults["lr_schedule"] == "constant" and defaults["amp"] is None
    assert (defaults["grad_accum_steps"], defaults["compile"], defaults["checkpoint_every_s"]) == (
        1,
        False,
        None,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr_schedule", "linear"),
        ("warmup_steps", -1),
        ("amp", "fp8"),
        ("grad_accum_steps", 0),
        ("clip_grad_norm", 0),
        ("compile", "yes"),
        ("checkpoint_every_s", -5),
    ],
)
def test_a_bad_value_names_its_field(api: TestClient, field: str, value: object) -> None:
    answer = api.post("/v1/jobs", json=job(**{field: value}), headers=ADMIN)
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"][:3] == ["body", "hyperparameters", field]


def test_fp16_needs_a_cuda_worker(api: TestClient) -> None:
    db = api.app.state.db  # type: ignore[attr-defined]
    with db.transaction() as session:
        make_worker(session, "cpu-host")
    answer = api.post("/v1/jobs", json=job(amp="fp16"), headers=ADMIN)
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"] == ["body", "hyperparameters", "amp"]
    with db.transaction() as session:
        make_worker(session, "gpu-host", accelerator="cuda")
    assert api.post("/v1/jobs", json=job(amp="fp16"), headers=ADMIN).status_code == 201
