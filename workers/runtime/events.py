"""`report(**fields)`: one JSON line per call appended to TORCHJOBS_EVENTS.

The platform tails that file, so a rank never talks to the web stack (no HTTP client, no
database): a line is written whole with a single `write` on an O_APPEND descriptor, which keeps
lines from concurrent writers intact and lets the reader skip a half-written last line.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from workers.runtime.env import runtime_env


def report(**fields: Any) -> None:
    """Append `{"type": "progress", "ts": now, **fields}` to the events file; no-op if unset."""
    path = runtime_env().events_path
    if path is None:
        return
    append_event(path, {"type": "progress", "ts": time.time(), **fields})


def append_event(path: Path, event: dict[str, Any]) -> None:
    """Write one event as one line, flushed to the OS before returning."""
    line = json.dumps(_jsonable(event), allow_nan=False, separators=(",", ":")) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _jsonable(value: Any) -> Any:
    """Plain JSON for what scripts tend to pass: tensors, numpy scalars, paths; NaN becomes null
    because strict JSON (browsers, other languages) has no NaN."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "tolist"):  # torch tensors and numpy arrays/scalars, without importing them
        return _jsonable(value.tolist())
    return str(value)
