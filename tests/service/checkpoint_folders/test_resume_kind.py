"""The builtin and factory trainer resume `fsdp` from a DCP folder and every other mode from a
file: the other kind is a 422 naming `resume_from`, before the job waits for GPUs; a script job
resumes from either."""

from __future__ import annotations

import io

import torch

from tests.service.checkpoint_folders.conftest import Env, make_folder

BUILTIN = {"kind": "builtin", "model": "mlp", "dataset": "digits"}


def _file_checkpoint(env: Env) -> int:
    body = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, body)  # a bare state dict
    made = env.api.post(
        "/v1/checkpoints",
        params={"name": "plain.pt"},
        content=body.getvalue(),
        headers={**env.headers("alice"), "Content-Type": "application/octet-stream"},
    )
    assert made.status_code == 201, made.text
    return int(made.json()["id"])


def _submit(env: Env, mode: str, ckpt: int, entrypoint: dict | None = None) -> tuple[int, dict]:
    spec = {
        "mode": mode,
        "gpus_per_node": 1 if mode == "single" else 2,
        "entrypoint": entrypoint or BUILTIN,
        "resume_from": {"checkpoint_id": ckpt},
    }
    resp = env.api.post("/v1/jobs", json=spec, headers=env.headers("alice"))
    return resp.status_code, resp.json()


def test_each_trainer_mode_resumes_from_its_own_kind_only(env: Env) -> None:
    folder = make_folder(env, "alice", "epoch-0003", {".metadata": b"m", "__0_0.distcp": b"s"})["id"]
    plain = _file_checkpoint(env)
    status, body = _submit(env, "fsdp", plain)
    assert status == 422, body
    assert body["detail"][0]["loc"][-2:] == ["resume_from", "checkpoint_id"]
    assert "DCP folder" in body["detail"][0]["msg"]
    status, body = _submit(env, "ddp", folder)
    assert status == 422 and "is a folder" in body["detail"][0]["msg"], body
    assert _submit(env, "fsdp", folder)[0] == 201
    assert _submit(env, "single", plain)[0] == 201
