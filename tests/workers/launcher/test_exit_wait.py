"""ExitWait: one sleep that ends at the child's exit, with the same answers as Popen.wait."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.launcher.exit_wait import ExitWait


def child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "popen-fallback"])
def test_returns_none_while_running_and_the_status_once_exited(pidfd: bool) -> None:
    proc = child("import sys, time; time.sleep(0.5); sys.exit(7)")
    with ExitWait(proc) as exited:
        if not pidfd:
            exited.close()  # as on a kernel without pidfd_open
        assert exited.wait(0.05) is None
        assert proc.returncode is None
        # a long timeout does not hold the caller once the child has gone
        assert exited.wait(120.0) == 7
    assert proc.returncode == 7


def test_a_child_already_exited_is_answered_at_once() -> None:
    proc = child("raise SystemExit(3)")
    proc.wait()
    with ExitWait(proc) as exited:
        assert exited.wait(120.0) == 3


def test_a_negative_timeout_is_a_look_not_an_error() -> None:
    proc = child("import time; time.sleep(5)")
    try:
        with ExitWait(proc) as exited:
            assert exited.wait(-1.0) is None
    finally:
        proc.kill()
        proc.wait()
