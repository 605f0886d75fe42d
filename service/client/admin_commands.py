"""The admin's and the team's commands (contract §8, §9): users, usage, worker hosts."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from service.client.api import Client
from service.client.common import OutputOpt, TokenOpt, UrlOpt, api, emit, emit_list


def register(app: typer.Typer) -> None:
    users_app = typer.Typer(
        help="Users (admin): add, list, set a quota, revoke a token.", no_args_is_help=True
    )
    app.add_typer(users_app, name="users")
    users_app.command("add")(users_add)
    users_app.command("ls")(users_ls)
    users_app.command("set-quota")(users_set_quota)
    users_app.command("set-priority")(users_set_priority)
    users_app.command("revoke")(users_revoke)
    app.command()(usage)
    workers_app = typer.Typer(help="The worker hosts: list them, drain one, readmit one.")
    app.add_typer(workers_app, name="workers")
    workers_app.callback(invoke_without_command=True)(workers)
    workers_app.command("readmit")(workers_readmit)
    workers_app.command("drain")(workers_drain)
    admin_app = typer.Typer(help="Cluster operations (admin): drain a worker host.", no_args_is_help=True)
    app.add_typer(admin_app, name="admin")
    admin_app.command("drain")(workers_drain)
    admin_app.command("readmit")(workers_readmit)


def users_add(
    name: str,
    gpu_quota: Annotated[int | None, typer.Option(help="GPUs in use at once (default: no limit)")] = None,
    max_priority: Annotated[int, typer.Option(help="the highest priority their jobs may ask for")] = 0,
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """Add a user; prints their token, once: it is never shown again."""
    with api(url, token) as client:
        made = client.add_user(name, gpu_quota=gpu_quota, max_priority=max_priority)
    emit(made, output) if output == "json" else typer.echo(made["token"])


def users_ls(url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table") -> None:
    """Every user, with the GPUs their jobs hold now, their quota and max priority."""
    with api(url, token) as client:
        items = client.users()
    emit_list(items, output, ("id", "name", "admin", "gpus in use", "gpu quota", "max priority"), _user_row)


def users_set_quota(
    name: str,
    gpus: Annotated[str, typer.Argument(help="a number of GPUs, or 'none' for no limit")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """Set (or lift, with 'none') a user's GPU quota; the next scheduler pass applies it."""
    quota = None if gpus.lower() == "none" else _count(gpus)
    with api(url, token) as client:
        user = client.patch_user(_user_id(client, name), gpu_quota=quota)
    emit(user, output) if output == "json" else typer.echo(f"{user['name']}: gpu_quota {quota}")


def users_set_priority(
    name: str, max_priority: int, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table"
) -> None:
    """Set the highest priority a user's jobs may ask for."""
    with api(url, token) as client:
        user = client.patch_user(_user_id(client, name), max_priority=max_priority)
    emit(user, output) if output == "json" else typer.echo(f"{user['name']}: max_priority {max_priority}")


def users_revoke(name: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Revoke a user's token: refused from the next request on."""
    with api(url, token) as client:
        client.revoke(_user_id(client, name))
    typer.echo(f"{name}: token revoked")


def usage(
    user: Annotated[str | None, typer.Option(help="one user (the admin's choice)")] = None,
    since: Annotated[str | None, typer.Option(help="ISO time, e.g. 2026-12-01T00:00:00Z")] = None,
    until: Annotated[str | None, typer.Option(help="ISO time")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """GPU-seconds per user (yours; everyone's for the admin), every attempt counted."""
    with api(url, token) as client:
        page = client.usage(user=user, since=since, until=until)
    if output == "json":
        emit(page, output)
        return
    table = Table("user", "GPU-hours", "GPU-seconds", "jobs", "attempts")
    for row in page["items"]:
        seconds = row["gpu_seconds"]
        table.add_row(
            row["user"], f"{seconds / 3600:.2f}", f"{seconds:.0f}", str(row["jobs"]), str(row["attempts"])
        )
    Console().print(table)


def workers(
    ctx: typer.Context, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table"
) -> None:
    """Every worker: its state (online, offline, quarantined and why), GPUs free, isolation."""
    if ctx.invoked_subcommand is not None:
        return
    with api(url, token) as client:
        items = client.workers()
    emit_list(items, output, ("name", "state", "gpus free", "address", "isolation", "reason"), _worker_row)


def workers_readmit(
    name: str, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table"
) -> None:
    """Bring a quarantined worker back (admin): it takes work again (contract §8)."""
    with api(url, token) as client:
        worker = client.readmit(name)
    emit(worker, output) if output == "json" else typer.echo(f"{worker['name']}: {worker['state']}")


def workers_drain(name: str, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table") -> None:
    """Drain a worker (admin): nothing new goes there, its jobs are stopped as if preempted and
    queued again; `readmit` ends it (contract §12)."""
    with api(url, token) as client:
        worker = client.drain(name)
    emit(worker, output) if output == "json" else typer.echo(f"{worker['name']}: {worker['state']}")


def _count(text: str) -> int:
    if not text.isdigit():
        raise typer.BadParameter(f"{text!r}: a number of GPUs, or 'none'")
    return int(text)


def _user_id(client: Client, name: str) -> int:
    """Users are named on the command line and by id in the API."""
    for user in client.users():
        if user["name"] == name:
            return int(user["id"])
    typer.echo(f"error: no user named {name!r}", err=True)
    raise typer.Exit(1)


def _user_row(u: dict[str, Any]) -> list[str]:
    quota = "none" if u["gpu_quota"] is None else str(u["gpu_quota"])
    return [
        str(u["id"]),
        u["name"],
        "yes" if u["is_admin"] else "",
        str(u["gpus_in_use"]),
        quota,
        str(u["max_priority"]),
    ]


def _worker_row(w: dict[str, Any]) -> list[str]:
    free = f"{w['gpus_free']}/{w['gpus']}"
    return [w["name"], w["state"], free, w["address"], w["isolation"], w.get("reason") or ""]
