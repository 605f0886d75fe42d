"""Children started through `dying_with_parent` get SIGTERM when the thread that started them
ends, run the real command line unchanged, and never need a `preexec_fn`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from service.parent_death import PARENT_GONE_EXIT, dying_with_parent
from service.testing.harness import wait_for

SLEEPER = textwrap.dedent(
    """
    import signal, sys, time
    def on_term(*_):
        open(sys.argv[1], "w").write("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    open(sys.argv[1] + ".started", "w").write("x")
    time.sleep(60)
    """
)


def test_the_command_runs_unchanged_with_its_arguments_and_environment(tmp_path: Path) -> None:
    code = "import os, sys; print(sys.argv[1:], os.environ['MARK'], os.getcwd())"
    out = subprocess.run(
        dying_with_parent([sys.executable, "-c", code, "a b", "c"]),
        env={"MARK": "kept"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == f"['a b', 'c'] kept {tmp_path}"


def test_child_gets_sigterm_when_the_starting_thread_ends(tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    started: list[subprocess.Popen[bytes]] = []
    release = threading.Event()

    def starter() -> None:
        started.append(
            subprocess.Popen(
                dying_with_parent([sys.executable, "-c", SLEEPER, str(flag)]), start_new_session=True
            )
        )
        release.wait()

    thread = threading.Thread(target=starter)
    thread.start()
    wait_for(lambda: Path(f"{flag}.started").exists(), 30, "the child to start")
    time.sleep(0.3)
    assert started[0].poll() is None and not flag.exists()  # alive while its thread lives
    release.set()
    thread.join()
    assert started[0].wait(timeout=30) == 0
    assert flag.read_text() == "SIGTERM"


def test_child_whose_parent_is_already_gone_does_not_run(tmp_path: Path) -> None:
    """The guard checks its parent after arming the signal: a stale pid means it was too late."""
    argv = dying_with_parent([sys.executable, "-c", "open('ran', 'w')"])
    argv[argv.index(str(os.getpid()))] = "1"  # pretend another parent started it
    assert subprocess.run(argv, cwd=tmp_path).returncode == PARENT_GONE_EXIT
    assert not (tmp_path / "ran").exists()
