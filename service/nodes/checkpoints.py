"""A checkpoint rank 0 wrote: uploaded to storage, then recorded (retention applied)."""

from __future__ import annotations

from service.checkpoints.recording import store_rank_checkpoint

__all__ = ["store_rank_checkpoint"]
