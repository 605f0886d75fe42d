"""Is an uploaded file a checkpoint we can resume from? Decided in a throwaway subprocess.

The server never unpickles untrusted bytes itself. `check_upload` runs

    python -m service.checkpoints.upload_check PATH NAME

in an empty working folder, with a minimal environment (no credentials, no TORCHJOBS_*
settings) and a timeout. The child reads the file and checks its layout with the runtime's own
reader (`workers.runtime.checkpoint`, the code a resumed job will use), so an accepted upload
is one that resumes: `torch.load(weights_only=True)` only, which refuses any pickle that would
import or call arbitrary objects before anything in it runs, its tensors memory-mapped. It
prints a JSON summary, or exits 2 with the reason on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REFUSED_EXIT = 2
_REPO_ROOT = str(Path(__file__).resolve().parents[2])


class UploadRefused(Exception):
    """The file is not a checkpoint we accept; the message says why, for the uploader."""


class UploadTimedOut(UploadRefused):
    """No verdict within the time allowed: says nothing about the file, so never remembered."""


@dataclass(frozen=True, kw_only=True)
class UploadInfo:
    epoch: int | None
    step: int | None


def check_upload(path: str, name: str, timeout_s: float) -> UploadInfo:
    """Validate `path` in a subprocess; raises UploadRefused with the reason."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    with tempfile.TemporaryDirectory(prefix="torchjobs-check-") as cwd:
        env["HOME"] = cwd
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "service.checkpoints.upload_check", os.path.abspath(path), name],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise UploadTimedOut(f"the file could not be validated within {timeout_s:g}s") from None
    if proc.returncode == REFUSED_EXIT:
        reason = proc.stderr.decode(errors="replace").strip().splitlines()
        raise UploadRefused(reason[-1][:2000] if reason else "not a checkpoint")
    if proc.returncode != 0:
        raise UploadRefused(
            f"the file could not be loaded as a checkpoint (the validator ended with code {proc.returncode})"
        )
    try:
        summary = json.loads(proc.stdout.decode())
        return UploadInfo(epoch=_opt_int(summary.get("epoch")), step=_opt_int(summary.get("step")))
    except (ValueError, AttributeError):
        raise UploadRefused("the validator gave no answer") from None


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


# -- the child ---------------------------------------------------------------------------


def _summary(path: str, name: str) -> dict[str, Any]:
    """The upload's epoch and step (None where its layout records none), or UploadRefused with
    the runtime reader's reason."""
    from workers.runtime.checkpoint import normalize_checkpoint, read_checkpoint
    from workers.runtime.errors import CheckpointError

    try:
        raw = read_checkpoint(path, source=name, mmap=True)
        _, _, epoch, step, _ = normalize_checkpoint(raw, source=name)
    except CheckpointError as exc:
        raise UploadRefused(str(exc)) from None
    layout = isinstance(raw, Mapping) and "state_dict" in raw
    return {
        "epoch": epoch if layout and "epoch" in raw else None,
        "step": step if layout and "step" in raw else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m service.checkpoints.upload_check PATH NAME", file=sys.stderr)
        return REFUSED_EXIT
    try:
        summary = _summary(args[0], args[1])
    except UploadRefused as exc:
        print(" ".join(str(exc).split()), file=sys.stderr)
        return REFUSED_EXIT
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
