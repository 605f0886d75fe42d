"""The `torchjobs` command (contract §1): server-side processes and the client.

The server side (uvicorn, FastAPI, SQLAlchemy, the migrations) is imported by its four commands
only: a client command (`ls`, `submit`, `watch`, ...) loads the client and nothing else, 0.8 s
of imports against 3.4 s (`torchjobs --help`) when the server's came with every call.
"""

from __future__ import annotations

from typing import Annotated

import httpx
import typer

from service.client import admin_commands, webhook_commands
from service.client import commands as client_cmds

app = typer.Typer(
    help="torchjobs: a small, sharp PyTorch training-job service.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database commands.", no_args_is_help=True)
app.add_typer(db_app, name="db")
client_cmds.register(app)
admin_commands.register(app)
webhook_commands.register(app)


@app.callback()
def client_defaults(url: client_cmds.UrlOpt = None, token: client_cmds.TokenOpt = None) -> None:
    """torchjobs: a small, sharp PyTorch training-job service. `--url`/`--token` given here
    hold for the client command that follows (they may also follow the command)."""
    client_cmds.CLIENT_DEFAULTS.set(client_cmds.ClientDefaults(url=url, token=token))


@app.command()
def up(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    gpus: Annotated[
        int | None, typer.Option(help="GPU slots of the local worker (default: detected)")
    ] = None,
    accelerator: Annotated[str, typer.Option(help="auto | cuda | cpu")] = "auto",
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="the components' logs here, not in TORCHJOBS_HOME/logs")
    ] = False,
) -> None:
    """Everything on one machine: API, scheduler, one local worker, SQLite, embedded broker."""
    from service.cli.processes import run_up

    run_up(host, port, gpus, accelerator, verbose)


@app.command()
def server(
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    no_scheduler: Annotated[bool, typer.Option("--no-scheduler", help="API only")] = False,
    workers: Annotated[
        int, typer.Option(min=1, max=64, help="API processes on the one port (a host's cores; default 1)")
    ] = 1,
) -> None:
    """The API server (and the scheduler) against TORCHJOBS_DATABASE_URL and TORCHJOBS_BROKER_URL."""
    from service.cli.processes import run_server
    from service.config import Settings

    run_server(Settings(), host, port, scheduler=not no_scheduler, processes=workers)


@app.command()
def worker(
    name: Annotated[str, typer.Option(help="unique name of this host")],
    gpus: Annotated[int | None, typer.Option(help="GPU slots (default: CUDA device count)")] = None,
    accelerator: Annotated[str, typer.Option(help="auto | cuda | cpu")] = "auto",
    address: Annotated[str | None, typer.Option(help="address other nodes use to reach this host")] = None,
) -> None:
    """A Celery worker for one host."""
    if accelerator not in ("auto", "cuda", "cpu"):
        raise typer.BadParameter("--accelerator is auto, cuda or cpu")
    from service.cli.processes import run_worker_cmd

    run_worker_cmd(name, gpus, accelerator, address)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the Alembic migrations."""
    from service.cli.processes import run_db_upgrade

    run_db_upgrade()
    typer.echo("database is at the latest revision")


def main() -> None:
    try:
        app()
    except httpx.TransportError as exc:  # a client command that could not reach the server
        typer.echo(f"error: could not reach {_target(exc)}: {exc or type(exc).__name__}", err=True)
        raise SystemExit(2) from None


def _target(exc: httpx.TransportError) -> str:
    try:
        return str(exc.request.url)
    except RuntimeError:  # raised before a request was made
        return "the server"


if __name__ == "__main__":
    main()
