"""`torchjobs code push|ls`: your own code, packed from a folder (contract §6)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from service.client.api import Client
from service.client.common import OutputOpt, TokenOpt, UrlOpt, api, console, emit


def register(app: typer.Typer) -> None:
    code_app = typer.Typer(
        help="Your own code: upload a folder, list what you uploaded.", no_args_is_help=True
    )
    app.add_typer(code_app, name="code")
    code_app.command("push")(code_push)
    code_app.command("ls")(code_ls)


def push_code(client: Client, folder: Path, name: str | None = None) -> dict[str, Any]:
    try:
        return client.push_code(folder, name)
    except OSError as exc:
        console.print(f"[red]error[/red] {folder}: {exc}")
        raise typer.Exit(2) from None


def code_push(
    folder: Annotated[Path, typer.Argument(help="the folder to pack", exists=True, file_okay=False)],
    name: Annotated[str | None, typer.Option(help="default: the folder's name")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """Pack and upload a folder (unless the server has it already); prints the code id."""
    with api(url, token) as client:
        code = push_code(client, folder, name)
    emit(code, output) if output == "json" else typer.echo(code["id"])


def code_ls(url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table") -> None:
    """Your uploaded code, newest first."""
    with api(url, token) as client:
        items = client.list_code()
    if output == "json":
        emit({"items": items}, output)
        return
    table = Table("id", "name", "files", "size", "unpacked", "created")
    for c in items:
        table.add_row(
            c["id"][:12],
            c["name"],
            str(c["files"]),
            str(c["size_bytes"]),
            str(c["unpacked_bytes"]),
            c["created_at"],
        )
    Console().print(table)
