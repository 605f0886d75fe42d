"""The worker's caches (code and environments) and the client's packing."""

from __future__ import annotations

import os
import tarfile
import time
from pathlib import Path

from service.client.pack import pack_folder
from workers.code_cache import prune, sweep_staging


def _folder(root: Path, name: str, size: int, used: float) -> Path:
    path = root / name
    path.mkdir()
    (path / "f").write_bytes(bytes(size))
    os.utime(path, (used, used))
    return path


def test_prune_takes_the_least_recently_used_idle_folders_first(tmp_path: Path) -> None:
    now = time.time()
    old = _folder(tmp_path, "old", 1000, now - 7200)
    older = _folder(tmp_path, "older", 1000, now - 9000)
    busy = _folder(tmp_path, "busy", 1000, now - 60)  # used a minute ago: a node may need it
    keep = _folder(tmp_path, "keep", 1000, now)
    prune(tmp_path, max_bytes=3000, keep=keep)
    assert not older.exists() and old.exists() and busy.exists() and keep.exists()
    prune(tmp_path, max_bytes=0, keep=keep)
    assert not old.exists() and busy.exists()  # over the cap, but in use recently
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_sweep_removes_what_dead_builders_left(tmp_path: Path) -> None:
    (tmp_path / ".abc.building-999999999").mkdir()
    (tmp_path / f".abc.building-{os.getpid()}").mkdir()  # a live process: its build goes on
    (tmp_path / ".x.removing-1").mkdir()
    (tmp_path / ".abc.lock").touch()
    sweep_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".abc.building-{os.getpid()}", ".abc.lock"]


def test_packing_is_stable_and_keeps_every_file(tmp_path: Path) -> None:
    src = tmp_path / "proj"
    (src / "src" / "lib").mkdir(parents=True)
    (src / "src" / "lib" / "m.py").write_text("x = 1\n")
    (src / "a.py").write_text("print(1)\n")
    os.link(src / "a.py", src / "b.py")  # a second name of the same file
    (src / "lib").symlink_to("src/lib")  # a link to a folder
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    first, second = pack_folder(src), pack_folder(src)
    assert first.sha256 == second.sha256 and first.data == second.data
    out = tmp_path / "packed.tar.gz"
    out.write_bytes(first.data)
    with tarfile.open(out) as tar:
        kinds = {m.name: m.type for m in tar.getmembers()}
    assert kinds == {
        "a.py": tarfile.REGTYPE,
        "b.py": tarfile.REGTYPE,
        "lib": tarfile.SYMTYPE,
        "src/lib/m.py": tarfile.REGTYPE,
    }
