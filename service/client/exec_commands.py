"""`torchjobs exec`, `shell` and `forward` (contract §14): into a running job.

`exec` exits with the remote command's exit code (1 when the session ended without one: the
job ended, or the token was revoked); a refusal exits 2 with the server's reason.
"""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from service.client import exec_client
from service.client.common import TokenOpt, UrlOpt, console, make_client
from service.client.errors import ApiError

NodeOpt = Annotated[int, typer.Option("--node", help="node rank")]
RankOpt = Annotated[int, typer.Option("--rank", help="local rank on that node")]
DEFAULT_SHELL = "sh -c 'if command -v bash >/dev/null; then exec bash -i; else exec sh -i; fi'"


def register(app: typer.Typer) -> None:
    app.command("exec")(exec_)
    app.command()(shell)
    app.command()(forward)


def _where(url: str | None, token: str | None) -> tuple[str, str | None]:
    """The server and token a client command would use (flags, environment, token file)."""
    with make_client(url, token) as client:
        auth = client.http.headers.get("Authorization", "")
        return str(client.http.base_url), auth.removeprefix("Bearer ") or None


def _ended(code: int) -> None:
    if code < 0:
        console.print("[red]the session ended without an exit code (the job ended?)[/red]")
        raise typer.Exit(1)
    raise typer.Exit(code)


def exec_(
    job_id: int,
    cmd: Annotated[list[str], typer.Argument(help="the command and its arguments (after --)")],
    node: NodeOpt = 0,
    rank: RankOpt = 0,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Run a command inside a running rank's sandbox; its exit code is this command's."""
    server, secret = _where(url, token)
    try:
        code = exec_client.exec_streaming(server, secret, job_id, shlex.join(cmd), node, rank)
    except ApiError as exc:
        console.print(f"[red]error {exc.status_code}[/red]: {exc.detail}")
        raise typer.Exit(2) from None
    _ended(code)


def shell(
    job_id: int,
    node: NodeOpt = 0,
    rank: RankOpt = 0,
    cmd: Annotated[str, typer.Option("--cmd", help="the command line to run on the pty")] = DEFAULT_SHELL,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """An interactive shell on a pty inside a running rank's sandbox."""
    server, secret = _where(url, token)
    try:
        code = exec_client.shell(server, secret, job_id, cmd, node, rank)
    except ApiError as exc:
        console.print(f"[red]error {exc.status_code}[/red]: {exc.detail}")
        raise typer.Exit(2) from None
    _ended(code)


def forward(
    job_id: int,
    ports: Annotated[str, typer.Argument(help="[LOCAL:]REMOTE")],
    node: NodeOpt = 0,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Forward 127.0.0.1:LOCAL to port REMOTE inside the job's sandbox, until Ctrl-C."""
    try:
        local, remote = exec_client.parse_forward(ports)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    server, secret = _where(url, token)

    def ready(port: int) -> None:
        typer.echo(f"forwarding 127.0.0.1:{port} -> job {job_id} node {node} port {remote} (Ctrl-C to stop)")

    try:
        exec_client.forward(server, secret, job_id, node, local, remote, ready)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    except OSError as exc:
        console.print(f"[red]error[/red]: cannot listen on 127.0.0.1:{local}: {exc}")
        raise typer.Exit(2) from None
