"""The local copies of resume checkpoints stay under their bound, newest kept."""

from __future__ import annotations

import os
from pathlib import Path

from workers.node import prune_cache


def test_prune_keeps_the_new_copy_and_drops_the_least_recently_used(tmp_path: Path) -> None:
    paths = []
    for i in range(4):
        path = tmp_path / f"{i}.pt"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))
        paths.append(path)
    prune_cache(tmp_path, max_bytes=250, keep=paths[0])
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["0.pt", "3.pt"]
