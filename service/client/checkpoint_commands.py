"""Checkpoint commands: checkpoints (a job's), download (resumed and verified), upload."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from service.client.common import OutputLongOpt, OutputOpt, TokenOpt, UrlOpt, api, console, emit
from service.client.download import ChecksumMismatch, UnsafeListing, folder_destination
from service.client.folder_pack import FolderChanged


def register(app: typer.Typer) -> None:
    app.command()(checkpoints)
    app.command()(download)
    app.command()(upload)


def checkpoints(job_id: int, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table") -> None:
    """List a job's checkpoints, oldest first."""
    with api(url, token) as client:
        items = client.checkpoints(job_id)
    if output == "json":
        emit({"items": items}, output)
        return
    table = Table("id", "name", "epoch", "step", "size", "sha256", "created")
    for c in items:
        table.add_row(
            str(c["id"]),
            c["name"],
            str(c["epoch"]),
            str(c["step"]),
            str(c["size_bytes"]),
            c["sha256"][:12],
            c["created_at"][:19],
        )
    Console().print(table)


def download(
    ckpt_id: int,
    out: Annotated[
        Path | None,
        typer.Option("-o", "--out", help="destination file (a folder checkpoint: folder, NAME/ goes in it)"),
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputLongOpt = "table",
) -> None:
    """Download a checkpoint with a progress bar; resumes and verifies its SHA-256.

    A folder checkpoint is fetched file by file into OUT/NAME/ (OUT defaults to the current
    folder), every file and the manifest verified."""
    with api(url, token) as client:
        try:
            meta = client.checkpoint(ckpt_id)
            folder = meta.get("kind") == "folder"
            dest = str(out or ("." if folder else meta["name"]))
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=output == "json",
            ) as bar:
                task = bar.add_task(meta["name"], total=meta["size_bytes"])
                sha = client.download(ckpt_id, dest, lambda d, t: bar.update(task, completed=d, total=t))
        except ChecksumMismatch as exc:
            console.print(f"[red]error[/red]: {exc}; the unverified bytes were not kept")
            raise typer.Exit(1) from None
        except UnsafeListing as exc:
            console.print(f"[red]error[/red]: {exc}; nothing was written")
            raise typer.Exit(1) from None
        except httpx.TransportError as exc:
            console.print(f"[red]error[/red]: {exc!r}; run the same command again to resume")
            raise typer.Exit(1) from None
    if folder:
        dest = folder_destination(ckpt_id, meta, dest)
    result = {"id": ckpt_id, "path": dest, "sha256": sha, "verified": True}
    emit(result, output) if output == "json" else typer.echo(f"{dest} sha256 {sha} verified")


def upload(
    path: Annotated[Path, typer.Argument(exists=True)],
    name: Annotated[str | None, typer.Option()] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """Upload your own checkpoint to resume from: a file, or a folder (its regular files)."""
    with api(url, token) as client:
        try:
            ckpt = client.upload(str(path), name)
        except FolderChanged as exc:
            console.print(f"[red]error[/red]: {exc}; nothing was kept, send it again once it is complete")
            raise typer.Exit(1) from None
    emit(ckpt, output) if output == "json" else typer.echo(ckpt["id"])
