"""What a job node keeps on the host's disk (contract §7 v3): its run folder and TMPDIR added
up as the job left them, links never followed, a look that stops once past the limit."""

from __future__ import annotations

import os
from pathlib import Path

from workers.launcher import disk


def _fill(path: Path, mb: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for _ in range(mb):
            fh.write(os.urandom(1024 * 1024))


def test_the_folders_are_added_up(tmp_path: Path) -> None:
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    _fill(run / "home" / "a.bin", 3)
    _fill(tmp / "deep" / "er" / "b.bin", 2)
    tally = disk.usage((run, tmp), limit=100 * 1024 * 1024)
    assert 5 * 1024 * 1024 <= tally.bytes < 6 * 1024 * 1024 and not tally.over


def test_links_count_nothing_and_lead_nowhere(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _fill(tmp_path / "host" / "big.bin", 4)
    (run / "to-host").symlink_to(tmp_path / "host")
    (run / "to-root").symlink_to("/")
    tally = disk.usage((run,), limit=1024 * 1024)
    assert tally.bytes < 1024 * 1024 and not tally.over


def test_past_the_limit_the_look_stops_and_names_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for i in range(5):
        _fill(run / f"f{i}.bin", 1)
    tally = disk.usage((run,), limit=2 * 1024 * 1024)
    assert tally.over and tally.bytes <= 4 * 1024 * 1024  # stopped before all five
    assert tally.why().startswith("disk limit: the node's folders held more than its 2 MB")


def test_too_deep_a_tree_is_past_the_limit(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    here = folder
    for _ in range(disk.MAX_DEPTH + 3):
        here = here / "d"
    here.mkdir(parents=True)
    tally = disk.usage((folder,), limit=10**12)
    assert tally.over and tally.too_deep and "deeper" in tally.why()


def test_missing_folders_are_nothing(tmp_path: Path) -> None:
    assert disk.usage((tmp_path / "gone",), limit=1).bytes == 0
