"""A job resumes only from a file that `torch.load(weights_only=True)` accepts (contract §5),
and a file that does not is refused at submit with a 422, not when the ranks load it.

Most checkpoints are known good by where they came from: an upload was validated when it came
in, and the builtin trainer writes only tensors and plain values. A file a script (or a
factory's model) wrote may hold anything, so the first resume from it fetches it and runs the
upload validator on it (`upload_check`: a throwaway subprocess, nothing in the file runs).
The verdict depends only on the bytes, so it is remembered by SHA-256 for this process.
"""

from __future__ import annotations

import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from service.checkpoints.upload_check import UploadRefused, UploadTimedOut, check_upload
from service.config import Settings
from service.errors import InvalidSpec
from service.jobs import repository as jobs_repo
from service.models import Checkpoint
from service.storage import Storage

MAX_VERDICTS = 4096
_verdicts: OrderedDict[str, str | None] = OrderedDict()  # sha256 -> None (resumable) or why not
_verdicts_lock = threading.Lock()
_checks = threading.BoundedSemaphore(2)  # each check loads a whole file in a subprocess


@dataclass(frozen=True, kw_only=True)
class ResumeFile:
    id: int
    name: str
    sha256: str
    storage_key: str
    trusted: bool  # an upload (validated on the way in) or the builtin trainer's own file
    kind: str = "file"  # or "folder" (contract §11)


def resume_file(session: Session, ckpt: Checkpoint) -> ResumeFile:
    source = jobs_repo.job_by_id(session, ckpt.job_id) if ckpt.job_id is not None else None
    # a folder (contract §11) is never unpickled by the server: only its owner's jobs open it
    trusted = (
        ckpt.kind == "folder"
        or ckpt.job_id is None
        or (source is not None and source.entrypoint.get("kind") == "builtin")
    )
    return ResumeFile(
        id=ckpt.id,
        name=ckpt.name,
        sha256=ckpt.sha256,
        storage_key=ckpt.storage_key,
        trusted=trusted,
        kind=ckpt.kind,
    )


def check_resumable(storage: Storage, settings: Settings, file: ResumeFile, field: str) -> None:
    """Raises the 422 (naming `resume_from.<field>`) when a job may not resume from `file`."""
    reason = refusal(storage, settings, file)
    if reason is not None:
        why = f"checkpoint {file.id} cannot be resumed from: {reason}"
        raise InvalidSpec(("resume_from", field), why, "checkpoint_refused")


def refusal(storage: Storage, settings: Settings, file: ResumeFile) -> str | None:
    """None when a job may resume from the file, else why not."""
    if file.trusted:
        return None
    with _verdicts_lock:
        if file.sha256 in _verdicts:
            _verdicts.move_to_end(file.sha256)
            return _verdicts[file.sha256]
    with _checks:
        reason, definite = _validate(storage, settings, file)
    if definite:
        with _verdicts_lock:
            _verdicts[file.sha256] = reason
            while len(_verdicts) > MAX_VERDICTS:
                _verdicts.popitem(last=False)
    return reason


def _validate(storage: Storage, settings: Settings, file: ResumeFile) -> tuple[str | None, bool]:
    """(reason or None, whether that is a verdict on these bytes worth remembering)."""
    folder = settings.home / "tmp"
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="resume-check-", dir=folder) as tmp:
        local = Path(tmp) / "checkpoint.pt"
        try:
            got = storage.download_to(file.storage_key, str(local))
        except Exception as exc:  # each storage backend raises its own kinds
            return f"its stored file could not be read ({exc.__class__.__name__})", False
        if got != file.sha256:
            return "its stored file failed its SHA-256 check", False
        try:
            check_upload(str(local), file.name, settings.upload_validate_timeout_s)
        except UploadTimedOut as exc:
            return str(exc), False
        except UploadRefused as exc:
            return str(exc), True
    return None, True


def forget_verdicts() -> None:
    """For tests: the next check runs the validator again."""
    with _verdicts_lock:
        _verdicts.clear()
