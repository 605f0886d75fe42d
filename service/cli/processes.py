"""`torchjobs up`, `server`, `worker` and `db upgrade`: the processes of contract §1."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import typer
import uvicorn

from service.auth.tokens import read_or_create_admin_token
from service.config import Settings
from service.migrate import schema_is_current, upgrade


def _setup_logging(settings: Settings) -> None:
    from service.logs_setup import configure_logging

    configure_logging(settings)


def run_up(host: str, port: int, gpus: int | None, accelerator: str) -> None:
    settings = Settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    _setup_logging(settings)
    upgrade(settings)
    read_or_create_admin_token(settings)
    cmd = [
        sys.executable,
        "-m",
        "service.cli.main",
        "worker",
        "--name",
        "local",
        "--accelerator",
        accelerator,
        "--address",
        "127.0.0.1",
    ]
    if gpus is not None:
        cmd += ["--gpus", str(gpus)]
    worker = subprocess.Popen(cmd, env=os.environ.copy(), preexec_fn=_die_with_parent)
    token_where = "TORCHJOBS_ADMIN_TOKEN" if settings.admin_token else str(settings.admin_token_file)
    typer.echo(f"torchjobs is up at http://{host}:{port}  (admin token: {token_where})", err=True)
    try:
        run_server(settings, host, port, scheduler=True)
    finally:
        _stop_child(worker, settings.cancel_grace_s + 10)


def _die_with_parent() -> None:
    """The local worker gets SIGTERM if `up` itself dies, so no orphan keeps the slots."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _stop_child(proc: subprocess.Popen[bytes], wait_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def require_current_schema(settings: Settings) -> None:
    if not schema_is_current(settings):
        typer.echo("the database is not at the latest migration: run `torchjobs db upgrade` first", err=True)
        raise typer.Exit(2)


def run_server(settings: Settings, host: str, port: int, scheduler: bool) -> None:
    from service.app import create_app

    _setup_logging(settings)
    require_current_schema(settings)
    app = create_app(settings, scheduler=scheduler)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        log_config=None if settings.log_json else uvicorn.config.LOGGING_CONFIG,
    )


def run_worker_cmd(name: str, gpus: int | None, accelerator: str, address: str | None) -> None:
    from workers.agent import run_worker

    settings = Settings()
    _setup_logging(settings)
    require_current_schema(settings)
    run_worker(settings, name=name, gpus=gpus, accelerator=accelerator, address=address)


def run_db_upgrade() -> None:
    settings = Settings()
    upgrade(settings)
    logging.getLogger("torchjobs").info("database at head")
