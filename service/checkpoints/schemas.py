"""Checkpoint responses. `CheckpointOut` itself lives in `service.schemas`: jobs and events embed it."""

from __future__ import annotations

from pydantic import BaseModel

from service.schemas import CheckpointOut


class CheckpointList(BaseModel):
    items: list[CheckpointOut]
