"""`torchjobs webhooks add|ls|rm|deliveries` (contract §10)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from service.client.common import OutputOpt, TokenOpt, UrlOpt, api, emit, emit_list


def _events(value: str) -> list[str]:
    events = [e.strip() for e in value.split(",") if e.strip()]
    if not events:
        raise typer.BadParameter("name at least one event type, e.g. state,checkpoint")
    return events


def register(app: typer.Typer) -> None:
    hooks = typer.Typer(help="Webhooks: your jobs' events POSTed to a URL, signed.", no_args_is_help=True)
    app.add_typer(hooks, name="webhooks")
    hooks.command("add")(add)
    hooks.command("ls")(ls)
    hooks.command("rm")(rm)
    hooks.command("deliveries")(deliveries)


def add(
    url: str,
    events: Annotated[str, typer.Option(help="comma-separated event types")] = "state",
    secret: Annotated[
        str | None, typer.Option(help="the HMAC key (16+ characters); generated when not given")
    ] = None,
    all_jobs: Annotated[bool, typer.Option("--all", help="every user's jobs (admin only)")] = False,
    url_: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """Register URL; prints the webhook's id and its secret, which is never shown again."""
    body: dict[str, Any] = {"url": url, "events": _events(events), "all": all_jobs}
    if secret is not None:
        body["secret"] = secret
    with api(url_, token) as client:
        made = client.add_webhook(body)
    if output == "json":
        emit(made, output)
    else:
        typer.echo(f"webhook {made['id']}: {made['url']} ({','.join(made['events'])})")
        typer.echo(f"secret: {made['secret']}")


def ls(url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table") -> None:
    """Your webhooks (the admin: everyone's)."""
    with api(url, token) as client:
        items = client.list_webhooks()
    emit_list(
        items,
        output,
        ("id", "url", "events", "all", "owner", "created"),
        lambda w: [
            str(w["id"]),
            w["url"],
            ",".join(w["events"]),
            "yes" if w["all"] else "",
            w["owner"],
            str(w["created_at"]),
        ],
    )


def rm(webhook_id: int, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Delete a webhook; its pending deliveries are dropped with it."""
    with api(url, token) as client:
        client.delete_webhook(webhook_id)
    typer.echo(f"webhook {webhook_id} deleted")


def deliveries(
    webhook_id: int,
    limit: Annotated[int, typer.Option(help="newest first, at most this many")] = 20,
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """A webhook's latest deliveries: status, tries, the last answer."""
    with api(url, token) as client:
        items = client.webhook_deliveries(webhook_id, limit)
    emit_list(
        items,
        output,
        ("event", "status", "tries", "last answer", "delivered"),
        lambda d: [
            d["event_id"],
            d["status"],
            str(d["attempt_count"]),
            str(d["last_status_code"] or d["last_error"] or ""),
            str(d["delivered_at"] or ""),
        ],
    )
