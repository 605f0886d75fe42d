"""A finished job's final weights, as its latest checkpoint holds them: for tests that compare a
job stopped and resumed (a retry, a preemption) with the same job run straight through."""

from __future__ import annotations

import io
from typing import Any

import torch

from service.testing.harness import Stack


def final_weights(stack: Stack, job: dict[str, Any]) -> dict[str, torch.Tensor]:
    with stack.client() as c:
        blob = c.get(job["latest_checkpoint"]["download_url"]).content
    return torch.load(io.BytesIO(blob), weights_only=True)["state_dict"]["net"]
