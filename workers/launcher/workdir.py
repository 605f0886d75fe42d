"""The node's private copy of the job's code (contract §6): each node writes in its own copy,
and in a sandbox the copy belongs to the sandbox's user, so no other job can touch it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def copy_code(source: Path, dest: Path, owner: tuple[int, int] | None) -> None:
    """Copy the unpacked code (links kept as links: they were checked to stay inside it)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest, symlinks=True)
    if owner is None:
        return
    os.chown(dest, *owner)
    for folder, dirs, files in os.walk(dest):
        for name in (*dirs, *files):
            os.chown(os.path.join(folder, name), *owner, follow_symlinks=False)
