"""What every client command shares: its options, the client it talks through, its output.

Every command takes `--output json` for scripts; API errors exit 2 with the server's reason.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from service.client.api import Client
from service.client.errors import ApiError
from service.client.settings import ClientSettings

console = Console(stderr=True)
OutputOpt = Annotated[str, typer.Option("--output", "-o", help="table | json")]
# `download` keeps -o for the destination file (contract: `download CKPT [-o PATH]`).
OutputLongOpt = Annotated[str, typer.Option("--output", help="table | json")]
UrlOpt = Annotated[str | None, typer.Option("--url", help="server URL (TORCHJOBS_URL)")]
TokenOpt = Annotated[str | None, typer.Option("--token", help="bearer token (TORCHJOBS_TOKEN)")]


@dataclass(frozen=True)
class ClientDefaults:
    """`torchjobs --url U --token T COMMAND`: given before the command, for every command."""

    url: str | None = None
    token: str | None = None


# Set by the app's callback (service/cli/main.py), which runs before the command in the
# same process; typer vendors click and keeps no public "current context" to read it from.
CLIENT_DEFAULTS: ContextVar[ClientDefaults | None] = ContextVar("client_defaults", default=None)


def make_client(url: str | None, token: str | None) -> Client:
    defaults = CLIENT_DEFAULTS.get() or ClientDefaults()
    url, token = url or defaults.url, token or defaults.token
    settings = ClientSettings()
    token = token or settings.token or settings.admin_token
    if token is None and settings.admin_token_file.exists():
        token = settings.admin_token_file.read_text().strip()
    return Client(url or settings.url, token)


@contextlib.contextmanager
def api(url: str | None, token: str | None) -> Iterator[Client]:
    """A client for one command; an API error ends the command with exit 2 and the reason."""
    with make_client(url, token) as client:
        try:
            yield client
        except ApiError as exc:
            _fail(exc)


def _fail(exc: ApiError) -> NoReturn:
    detail = exc.detail
    if isinstance(detail, list):
        for err in detail:
            loc = ".".join(str(p) for p in err.get("loc", []) if p != "body")
            console.print(f"[red]error[/red] {loc}: {err.get('msg')}")
    else:
        console.print(f"[red]error {exc.status_code}[/red]: {detail}")
    raise typer.Exit(2)


def emit(data: Any, output: str) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def emit_list(
    items: list[dict[str, Any]],
    output: str,
    columns: tuple[str, ...],
    row: Callable[[dict[str, Any]], list[str]],
) -> None:
    """A list command's answer: `{"items": [...]}` as JSON, or a table of one row per item."""
    if output == "json":
        emit({"items": items}, output)
        return
    table = Table(*columns)
    for item in items:
        table.add_row(*row(item))
    Console().print(table)
