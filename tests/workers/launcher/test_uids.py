"""A uid of its own for every job node (contract §7 v3): handed out in order from the range,
shared by every worker of the host through one state file, never one a process still holds."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from workers.launcher import uids
from workers.launcher.uids import UidPool, UidRange


def test_the_range_setting() -> None:
    assert uids.parse("2000000000-2000000009") == UidRange(2000000000, 2000000009)
    assert uids.parse("off") is None
    for bad in ("100-200", "5-", "abc", "3000-2000"):
        with pytest.raises(ValueError, match="TORCHJOBS_JOB_UIDS: "):
            uids.parse(bad)


def test_uids_come_in_order_and_round_again_only_after_the_whole_range(tmp_path: Path) -> None:
    pool = UidPool(UidRange(3_000_000_000, 3_000_000_002), tmp_path / "next")
    taken = [pool.take() for _ in range(5)]
    assert taken == [3_000_000_000, 3_000_000_001, 3_000_000_002, 3_000_000_000, 3_000_000_001]


def test_two_pools_on_one_state_file_never_hand_out_the_same_uid(tmp_path: Path) -> None:
    """Two workers of one host: each takes under the file's lock."""
    state = tmp_path / "next"
    pools = [UidPool(UidRange(3_000_000_000, 3_099_999_999), state) for _ in range(2)]
    got: list[int] = []
    lock = threading.Lock()

    def take(pool: UidPool) -> None:
        for _ in range(50):
            uid = pool.take()
            with lock:
                got.append(uid)

    threads = [threading.Thread(target=take, args=(p,)) for p in pools]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(set(got)) == 100


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another uid needs root")
def test_a_uid_a_process_still_holds_is_skipped(tmp_path: Path) -> None:
    held = 3_000_000_005
    proc = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={held}",
            f"--regid={held}",
            "--clear-groups",
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while os.stat(f"/proc/{proc.pid}").st_uid != held:  # setpriv has not switched yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pool = UidPool(UidRange(held, held + 1), tmp_path / "next")
        assert pool.take() == held + 1
        assert pool.take() == held + 1  # the range came round; the held one is skipped again
    finally:
        proc.kill()
        proc.wait()
