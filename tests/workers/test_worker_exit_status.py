"""A worker whose Celery consumer fails for good exits with a failure status, so that whatever
restarts workers (`up`'s keeper, systemd, a pod) starts it again. Celery's own `worker_main`
and `start` drop that status and exit 0, which reads as a requested stop."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import sys
    from celery import Celery, bootsteps
    from workers.agent import _run_celery_worker

    class Broken(bootsteps.StartStopStep):
        def start(self, consumer):
            raise RuntimeError("the consumer cannot go on")

    app = Celery("t", broker="memory://")
    app.steps["consumer"].add(Broken)
    argv = ["worker", "-P", "threads", "-c", "1", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "INFO"]
    sys.exit(_run_celery_worker(app, argv))
    """
)


def test_an_unrecoverable_celery_error_is_a_failed_exit() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert "Unrecoverable error" in done.stderr + done.stdout
    assert done.returncode == 1
