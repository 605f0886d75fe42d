"""Packing a working folder into a code archive (contract §6), the same bytes every time.

Left out: `.git`, `__pycache__`, `.venv` and whatever a `.torchjobsignore` in the folder names
(gitignore syntax). Members are sorted and their times, owners and modes normalised, and the
gzip header carries no time, so an unchanged folder packs to the same SHA-256 and is not sent
again: the server already has it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

ALWAYS_LEFT_OUT = (".git/", "__pycache__/", ".venv/", "*.pyc")
IGNORE_FILE = ".torchjobsignore"


@dataclass(frozen=True)
class Packed:
    data: bytes
    sha256: str
    files: int


def pack_folder(folder: Path) -> Packed:
    folder = folder.resolve()
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder")
    members = _members(folder, _ignored(folder))
    raw = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel in members:
            _add(tar, folder, rel)
    data = raw.getvalue()
    return Packed(data=data, sha256=hashlib.sha256(data).hexdigest(), files=len(members))


def _ignored(folder: Path) -> pathspec.PathSpec:
    lines = list(ALWAYS_LEFT_OUT)
    ignore = folder / IGNORE_FILE
    if ignore.is_file():
        lines += ignore.read_text().splitlines()
    return pathspec.PathSpec.from_lines("gitignore", lines)


def _members(folder: Path, ignored: pathspec.PathSpec) -> list[str]:
    """Relative paths of the files and links to pack, sorted; folders come with their files."""
    found = []
    for root, dirs, files in os.walk(folder):
        rel_root = os.path.relpath(root, folder)
        rel_root = "" if rel_root == "." else rel_root + "/"
        dirs[:] = sorted(d for d in dirs if not ignored.match_file(rel_root + d + "/"))
        linked = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        dirs[:] = [d for d in dirs if d not in linked]  # a link to a folder travels as a link
        for name in (*files, *linked):
            rel = rel_root + name
            if not ignored.match_file(rel):
                found.append(rel)
    return sorted(found)


def _add(tar: tarfile.TarFile, folder: Path, rel: str) -> None:
    path = folder / rel
    # a second name of a file travels as a file, never as a hard link member
    tar.inodes.clear()  # type: ignore[attr-defined]
    info = tar.gettarinfo(str(path), arcname=rel)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    if info.isreg():
        info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
        with path.open("rb") as fh:
            tar.addfile(info, fh)
    elif info.issym():
        tar.addfile(info)
    # sockets, fifos and devices in a working folder are not code: left out
