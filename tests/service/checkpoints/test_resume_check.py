"""The resume check on its own: which files are validated, and which verdicts are remembered.

Real storage (file://) and the real validator subprocess; the verdict cache is cleared around
every test.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.checkpoints import resume_check
from service.checkpoints.resume_check import ResumeFile, refusal
from service.config import Settings
from service.storage import Storage


class Opaque:
    """Anything weights_only=True refuses to rebuild."""


@pytest.fixture(autouse=True)
def fresh_verdicts() -> Iterator[None]:
    resume_check.forget_verdicts()
    yield
    resume_check.forget_verdicts()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", admin_token="x")


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return Storage(f"file://{tmp_path / 'store'}")


def stored(storage: Storage, tmp_path: Path, obj: object, key: str, trusted: bool = False) -> ResumeFile:
    local = tmp_path / f"{key}.local"
    torch.save(obj, local)
    sha = hashlib.sha256(local.read_bytes()).hexdigest()
    storage.put_local(str(local), key)  # moves the file
    return ResumeFile(id=1, name=key, sha256=sha, storage_key=key, trusted=trusted)


def good() -> dict[str, object]:
    return {"state_dict": {"net": {"w": torch.zeros(3)}}, "epoch": 1, "step": 5}


def test_a_file_weights_only_loads_is_accepted_and_remembered(
    storage: Storage, settings: Settings, tmp_path: Path
) -> None:
    file = stored(storage, tmp_path, good(), "good.pt")
    assert refusal(storage, settings, file) is None
    storage.delete(file.storage_key)  # the verdict needs no second look at the bytes
    assert refusal(storage, settings, file) is None


def test_a_file_that_needs_a_full_unpickle_is_refused_and_remembered(
    storage: Storage, settings: Settings, tmp_path: Path
) -> None:
    file = stored(storage, tmp_path, {**good(), "extra": Opaque()}, "opaque.pt")
    reason = refusal(storage, settings, file)
    assert reason is not None and "weights_only=True" in reason
    storage.delete(file.storage_key)
    assert refusal(storage, settings, file) == reason


def test_uploads_and_the_builtin_trainers_files_are_not_fetched(storage: Storage, settings: Settings) -> None:
    absent = ResumeFile(id=1, name="x.pt", sha256="0" * 64, storage_key="nowhere/x.pt", trusted=True)
    assert refusal(storage, settings, absent) is None


def test_a_missing_or_altered_file_is_refused_but_not_remembered(
    storage: Storage, settings: Settings, tmp_path: Path
) -> None:
    file = stored(storage, tmp_path, good(), "good.pt")
    altered = ResumeFile(id=1, name="good.pt", sha256="f" * 64, storage_key=file.storage_key, trusted=False)
    assert "SHA-256" in (refusal(storage, settings, altered) or "")
    missing = ResumeFile(id=2, name="gone.pt", sha256="e" * 64, storage_key="gone.pt", trusted=False)
    assert "could not be read" in (refusal(storage, settings, missing) or "")
    assert "f" * 64 not in resume_check._verdicts and "e" * 64 not in resume_check._verdicts


def test_a_plain_pickle_is_not_a_checkpoint(storage: Storage, settings: Settings, tmp_path: Path) -> None:
    local = tmp_path / "plain.pkl"
    local.write_bytes(pickle.dumps({"a": 1}))
    sha = hashlib.sha256(local.read_bytes()).hexdigest()
    storage.put_local(str(local), "plain.pkl")
    file = ResumeFile(id=3, name="plain.pkl", sha256=sha, storage_key="plain.pkl", trusted=False)
    assert refusal(storage, settings, file) is not None
