"""Checkpoints a node's ranks wrote: a file rank 0 wrote, uploaded then recorded (retention
applied); a node's part of a folder checkpoint, stored, and node 0's listing of the whole
folder once every node's part is (contract §11); what is left of unlisted parts when a node ends."""

from __future__ import annotations

from service.checkpoints.folders import end_node, note_look, part_horizon, resume_layout, store_part, try_list
from service.checkpoints.recording import store_rank_checkpoint

__all__ = [
    "end_node",
    "note_look",
    "part_horizon",
    "resume_layout",
    "store_part",
    "store_rank_checkpoint",
    "try_list",
]
