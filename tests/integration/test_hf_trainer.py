"""An unchanged Hugging Face Trainer script (contract §11) on 2 processes, on PostgreSQL, Redis,
a real Celery worker and torchrun: each `checkpoint-N/` it saves is one folder checkpoint with
every file (one `rng_state_<rank>.pth` per process among them), its manifest's SHA-256 verifies
against the files served, its tar is the same bytes twice and a Range of it is a slice of the
whole. Then the worker is SIGKILLed after the first checkpoint, started again, and the retried
attempt continues from that step by the framework's own resume logic (`get_last_checkpoint` on
`TORCHJOBS_CHECKPOINT_DIR`, where the retry finds the checkpoint placed).
The script is tests/sandbox_code/hf_trainer/train.py; its environment (transformers,
accelerate) is built over the worker's own torch."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client.api import Client
from service.testing import harness
from service.testing.harness import Stack, wait_for
from tests.redis_dbs import fresh_redis_url, release_redis_url

HF_TRAINER = Path(__file__).resolve().parents[1] / "sandbox_code" / "hf_trainer"
MAX_STEPS = 24  # 2 ranks x 8 a batch of 64 samples: 4 steps an epoch
SAVE_STEPS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, module_pg_url: str) -> Iterator[Stack]:
    home = Path(tmp_path_factory.mktemp("hf"))
    redis = fresh_redis_url()
    stack = harness.production_stack(home, module_pg_url, redis, workers={"w1": 2})
    yield stack
    stack.stop()
    release_redis_url(redis)


def folder_checkpoints(stack: Stack, job_id: int) -> list[dict[str, Any]]:
    with stack.client() as c:
        return [x for x in c.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"] if x["kind"] == "folder"]


def check_served_whole(stack: Stack, ckpt: dict[str, Any]) -> list[str]:
    """Every file's bytes against its SHA-256, the manifest against the checkpoint's; the tar
    twice, and one Range of it. Returns the paths."""
    with stack.client() as c:
        files = c.get(f"/v1/checkpoints/{ckpt['id']}/files").json()["items"]
        manifest = b""
        for f in sorted(files, key=lambda f: f["path"]):
            data = c.get(f"/v1/checkpoints/{ckpt['id']}/files/{f['path']}").content
            assert (len(data), hashlib.sha256(data).hexdigest()) == (f["size_bytes"], f["sha256"]), f
            manifest += f"{f['sha256']} {f['size_bytes']} {f['path']}\n".encode()
        assert hashlib.sha256(manifest).hexdigest() == ckpt["sha256"]
        tar = c.get(ckpt["download_url"]).content
        assert c.get(ckpt["download_url"]).content == tar
        part = c.get(ckpt["download_url"], headers={"Range": "bytes=1000-4999"})
        assert part.status_code == 206 and part.content == tar[1000:5000]
    return sorted(f["path"] for f in files)


def test_a_trainer_s_checkpoints_are_whole_and_its_retry_resumes_itself(stack: Stack) -> None:
    with Client(stack.url, harness.ADMIN_TOKEN) as client:
        code = client.push_code(HF_TRAINER)["id"]
    args = ["--max-steps", str(MAX_STEPS), "--save-steps", str(SAVE_STEPS), "--step-sleep", "1"]
    job = stack.submit(
        {
            "name": "hf-ddp",
            "mode": "ddp",
            "gpus_per_node": 2,
            "max_retries": 1,
            "code": code,
            "entrypoint": {"kind": "script", "path": "train.py", "args": args},
            "environment": {"pip": ["transformers==5.25.0", "accelerate==1.15.0"]},
        }
    )
    first = wait_for(lambda: folder_checkpoints(stack, job["id"]), 600, "the first checkpoint-N/")[0]
    paths = check_served_whole(stack, first)
    assert re.fullmatch(r"checkpoint-\d+", first["name"]), first
    assert {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(paths), paths
    assert any(p.startswith("model") for p in paths) and "optimizer.pt" in paths, paths

    stack.kill("worker-w1")  # with its ranks; the job's attempt is lost with it
    listed = {c["name"] for c in folder_checkpoints(stack, job["id"])}
    stack.start_worker("w1", 2)
    done = stack.wait_job(job["id"], timeout=600)
    assert done["state"] == "succeeded", stack.describe(job["id"])
    assert done["attempt"] == 2, done["attempts"]
    with stack.client() as c:
        log = c.get(f"/v1/jobs/{job['id']}/logs", params={"attempt": 2}).text
    resumed = re.findall(r"hf-trainer resumed from (checkpoint-\d+)", log)
    assert len(resumed) == 1 and resumed[0] in listed, (resumed, listed, log[-3000:])
    assert f"hf-trainer done: steps={MAX_STEPS}" in log, log[-3000:]
    # the resumed attempt's Trainer began at its checkpoint's step, not at 0
    starts = re.findall(r"hf-trainer starts at step (\d+)", log)
    assert starts == [resumed[0].removeprefix("checkpoint-")], (starts, log[-3000:])
    last = folder_checkpoints(stack, job["id"])
    assert f"checkpoint-{MAX_STEPS}" in {c["name"] for c in last}
    check_served_whole(stack, next(c for c in last if c["name"] == f"checkpoint-{MAX_STEPS}"))
    with httpx.Client(base_url=stack.url, timeout=30) as anonymous:
        assert anonymous.get(f"/v1/checkpoints/{first['id']}/files").status_code == 401
