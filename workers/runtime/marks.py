"""`checkpoint_done(NAME)`: a rank says a checkpoint folder is complete (contract §11).

Frameworks whose folders carry no mark of their own (no DCP `.metadata`, no
`trainer_state.json`) call it once every rank has written its files; the worker then takes the
folder at its next look instead of waiting for it to settle. The mark is an empty file named
NAME in `.torchjobs-done/` of `TORCHJOBS_CHECKPOINT_DIR` (a name starting with "." is never a
checkpoint itself); the worker reads only its name. No torch here: importing it is free.
"""

from __future__ import annotations

import os
from pathlib import Path

DONE_DIR = ".torchjobs-done"  # the same name as workers/launcher/folders.py reads


def checkpoint_done(name: str, checkpoint_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Mark the folder `name` in the checkpoint folder complete; the mark's path, or None
    outside a torchjobs job (no `TORCHJOBS_CHECKPOINT_DIR`)."""
    if not name or "/" in name or name.startswith(".") or name in (".", ".."):
        raise ValueError(f"not a checkpoint folder's name: {name!r}")
    base = checkpoint_dir if checkpoint_dir is not None else os.environ.get("TORCHJOBS_CHECKPOINT_DIR")
    if not base:
        return None
    marks = Path(base) / DONE_DIR
    marks.mkdir(parents=True, exist_ok=True)
    mark = marks / name
    mark.touch()
    return mark
