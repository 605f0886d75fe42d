"""Checkpoint responses. `CheckpointOut` itself lives in `service.schemas`: jobs and events embed it."""

from __future__ import annotations

from pydantic import BaseModel

from service.schemas import CheckpointOut


class CheckpointList(BaseModel):
    items: list[CheckpointOut]


class CheckpointFileOut(BaseModel):
    """One file of a checkpoint (contract §11); a file checkpoint is one, named as itself."""

    path: str
    size_bytes: int
    sha256: str
    node_rank: int


class CheckpointFileList(BaseModel):
    items: list[CheckpointFileOut]
