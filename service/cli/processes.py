"""`torchjobs up`, `server`, `worker` and `db upgrade`: the processes of contract §1."""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import typer
import uvicorn

from service.auth.tokens import read_or_create_admin_token
from service.cli.local_worker import LocalWorkerKeeper
from service.config import Settings
from service.migrate import schema_is_current, upgrade


def _setup_logging(settings: Settings, log_file: Path | None = None) -> None:
    from service.logs_setup import configure_logging

    configure_logging(settings, log_file)


def run_up(host: str, port: int, gpus: int | None, accelerator: str, verbose: bool = False) -> None:
    """Everything on one machine. The terminal gets a few lines (where to connect, the token,
    the worker, where the logs are) and errors; the components' logs go to
    `$TORCHJOBS_HOME/logs`, unless `verbose`."""
    settings = Settings()
    settings.home.mkdir(mode=0o700, parents=True, exist_ok=True)  # the database, tokens, checkpoints
    api_log = None if verbose else settings.logs_dir / "api.log"
    _setup_logging(settings, api_log)
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
    worker_log = None if verbose else settings.logs_dir / "worker.log"
    worker = LocalWorkerKeeper(cmd, settings.cancel_grace_s + 10, worker_log).start()
    token_where = "TORCHJOBS_ADMIN_TOKEN" if settings.admin_token else str(settings.admin_token_file)
    lines = [
        f"torchjobs is up at http://{host}:{port}  (admin token: {token_where})",
        f"  dashboard   http://{host}:{port}/",
        f"  worker      local ({accelerator}, {'detected' if gpus is None else gpus} GPU slots)",
    ]
    if not verbose:
        lines.append(f"  logs        {settings.logs_dir}/api.log, worker.log  (--verbose: here instead)")
    lines.append("  Ctrl-C stops everything")
    try:
        run_server(settings, host, port, scheduler=True, announce="\n".join(lines), log_file=api_log)
    finally:
        worker.stop()


def require_current_schema(settings: Settings) -> None:
    if not schema_is_current(settings):
        typer.echo("the database is not at the latest migration: run `torchjobs db upgrade` first", err=True)
        raise typer.Exit(2)


class AnnouncingServer(uvicorn.Server):
    """Says `announce` on stdout once the socket listens: a script that waits for the line
    can connect at once."""

    def __init__(self, config: uvicorn.Config, announce: str | None) -> None:
        super().__init__(config)
        self.announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.announce:
            typer.echo(self.announce)


def run_server(
    settings: Settings,
    host: str,
    port: int,
    scheduler: bool,
    announce: str | None = None,
    log_file: Path | None = None,
    processes: int = 1,
) -> None:
    from service.app import create_app

    _setup_logging(settings, log_file)
    require_current_schema(settings)
    if processes > 1:
        run_server_processes(settings, host, port, scheduler, processes)
        return
    app = create_app(settings, scheduler=scheduler)
    config = _uvicorn_config(app, settings, host, port, log_file)
    # uvicorn re-raises the Ctrl-C it has already handled; uvicorn.run swallows it the same way
    with contextlib.suppress(KeyboardInterrupt):
        AnnouncingServer(config, announce).run()


def _uvicorn_config(
    app: Any, settings: Settings, host: str, port: int, log_file: Path | None
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        log_config=None if settings.log_json or log_file else uvicorn.config.LOGGING_CONFIG,
    )


HEALTHCHECK_S = 60


def run_server_processes(settings: Settings, host: str, port: int, scheduler: bool, processes: int) -> None:
    """`server --workers N`: N API processes accepting on one socket the parent binds, so a
    host's cores serve requests (one process is bound by its GIL). uvicorn's supervisor
    starts them (spawned: nothing of the parent's threads or connections is inherited) and
    starts again one that dies. Each has its own engine, view cache and change feed, and its
    own scheduler thread: the pass's advisory lock lets one of them place at a time, as with
    several API hosts. The admin's row is made here first, not by N processes at once."""
    from uvicorn.supervisors import Multiprocess

    from service.auth.tokens import ensure_admin
    from service.db import Database

    db = Database(settings)
    try:
        with db.transaction() as session:
            ensure_admin(session, settings)
    finally:
        db.dispose()
    app = functools.partial(app_in_process, settings, scheduler)
    config = _uvicorn_config(app, settings, host, port, None)
    config.factory, config.workers = True, processes
    # A process is "hung" (killed, started again) when it does not answer the supervisor's
    # ping in this time; its first answer comes only after its imports, which take far more
    # than uvicorn's 5 s on a loaded host, where the default made a kill-and-restart loop.
    config.timeout_worker_healthcheck = HEALTHCHECK_S
    Multiprocess(config, sockets=[config.bind_socket()]).run()


def app_in_process(settings: Settings, scheduler: bool) -> Any:
    """One API process's app (`run_server_processes`), made in that process with the parent's
    settings (pickled to it, not read again from an environment that may differ)."""
    from service.app import create_app

    _setup_logging(settings)
    return create_app(settings, scheduler=scheduler)


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
