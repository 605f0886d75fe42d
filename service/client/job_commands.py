"""The job commands: submit, ls, show, watch, logs, cancel.

`watch` exits 0 when the job succeeded, 1 when it failed and 3 when it was cancelled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from service.client.code_commands import push_code
from service.client.common import OutputOpt, TokenOpt, UrlOpt, api, emit
from service.client.follow import print_logs, watch_job
from service.client.spec import build_spec, parse_dependency, parse_sweep
from service.states import JobState

EXIT_BY_STATE = {JobState.SUCCEEDED: 0, JobState.FAILED: 1, JobState.CANCELLED: 3}


def register(app: typer.Typer) -> None:
    app.command()(submit)
    app.command("ls")(ls)
    app.command()(show)
    app.command()(watch)
    app.command()(logs)
    app.command()(cancel)


def submit(
    file: Annotated[Path | None, typer.Argument(help="job spec YAML", exists=True, dir_okay=False)] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="key=value override")] = None,
    mode: Annotated[str | None, typer.Option()] = None,
    nodes: Annotated[
        str | None, typer.Option(help="N, or MIN:MAX for an elastic ddp/fsdp job (contract §12)")
    ] = None,
    gpus_per_node: Annotated[int | None, typer.Option()] = None,
    model: Annotated[str | None, typer.Option(help="builtin model")] = None,
    dataset: Annotated[str | None, typer.Option(help="builtin dataset")] = None,
    epochs: Annotated[int | None, typer.Option()] = None,
    name: Annotated[str | None, typer.Option()] = None,
    workdir: Annotated[
        Path | None,
        typer.Option(help="pack this folder as the job's code (uploaded unless the server has it)"),
    ] = None,
    depends_on: Annotated[
        list[str] | None,
        typer.Option("--depends-on", help="JOB_ID (it must succeed) or JOB_ID:ended; repeatable"),
    ] = None,
    sweep: Annotated[
        list[str] | None,
        typer.Option("--sweep", help="PATH=V1,V2,...: one child job per point of the grid; repeatable"),
    ] = None,
    max_parallel: Annotated[
        int | None, typer.Option("--max-parallel", help="a sweep's children running at once")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """Submit a job from a YAML file and/or flags."""
    flags = {
        "mode": mode,
        "nodes": parse_nodes(nodes) if nodes is not None else None,
        "gpus_per_node": gpus_per_node,
        "name": name,
        "hyperparameters.epochs": epochs,
    }
    if model or dataset:
        flags.update(
            {
                "entrypoint.kind": "builtin",
                "entrypoint.model": model or "cnn",
                "entrypoint.dataset": dataset or "digits",
            }
        )
    spec = build_spec(file, set_ or [], flags)
    if depends_on:
        spec["depends_on"] = [*spec.get("depends_on", []), *map(parse_dependency, depends_on)]
    if sweep:
        spec["sweep"] = parse_sweep(sweep, max_parallel)
    elif max_parallel is not None:
        raise typer.BadParameter("--max-parallel goes with --sweep")
    with api(url, token) as client:
        if workdir is not None:
            spec["code"] = push_code(client, workdir)["id"]
        job = client.submit(spec)
    if output == "json":
        emit(job, output)
    else:
        typer.echo(job["id"])


def parse_nodes(text: str) -> int | dict[str, int]:
    """`4`, or `2:4` for an elastic job's {"min", "max"}."""
    low, sep, high = text.partition(":")
    try:
        return {"min": int(low), "max": int(high)} if sep else int(low)
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give N or MIN:MAX, e.g. 2:4") from None


def ls(
    state: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option()] = 20,
    parent: Annotated[int | None, typer.Option(help="a sweep's id: its children")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """List jobs, newest first (a sweep's children, side by side, with --parent)."""
    with api(url, token) as client:
        page = client.list(state=state, limit=limit, parent=parent)
    if output == "json":
        emit(page, output)
    elif parent is not None:
        Console().print(children_table(page["items"]))
    else:
        Console().print(jobs_table(page["items"]))


def show(job_id: int, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "json") -> None:
    """Show one job."""
    with api(url, token) as client:
        emit(client.get(job_id), output)


def watch(job_id: int, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table") -> None:
    """Follow a job live until it ends; the exit code says how it ended."""
    with api(url, token) as client:
        final = watch_job(client, job_id, output)
    raise typer.Exit(EXIT_BY_STATE.get(JobState(final), 1))


def logs(
    job_id: int,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    node: Annotated[int, typer.Option()] = 0,
    rank: Annotated[int, typer.Option()] = 0,
    attempt: Annotated[int | None, typer.Option()] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Print one rank's output; -f follows it, surviving dropped connections."""
    with api(url, token) as client:
        print_logs(client, job_id, node, rank, attempt, follow)


def cancel(job_id: int, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table") -> None:
    """Cancel a job (harmless if it is already cancelling or cancelled)."""
    with api(url, token) as client:
        job = client.cancel(job_id)
    emit(job, output) if output == "json" else typer.echo(job["state"])


def _percent(job: dict[str, Any]) -> str:
    p = job["progress"]
    return f"{p['fraction'] * 100:.0f}%" if p.get("fraction") is not None else ""


def _number(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else ""


def _attempt(job: dict[str, Any]) -> str:
    """`3 (resized 2)`: the attempt, and how many before it were preempted or resized (§12)."""
    ended = [a.get("reason") for a in job.get("attempts") or [] if a.get("finished_at")]
    counts = {r: ended.count(r) for r in ("preempted", "resized") if r in ended}
    told = ", ".join(f"{r} {n}" for r, n in counts.items())
    return f"{job.get('attempt', 1)} ({told})" if told else str(job.get("attempt", 1))


def _nodes(job: dict[str, Any]) -> str:
    """N, or for an elastic job the nodes it has now and its range: `2 (2:4)`."""
    nodes = job["nodes"]
    if isinstance(nodes, dict):
        now = len(job.get("assignments") or []) or "-"
        return f"{now} ({nodes.get('min')}:{nodes.get('max')})"
    return str(nodes)


def jobs_table(items: list[dict[str, Any]]) -> Table:
    table = Table("id", "name", "state", "mode", "nodes×gpus", "attempt", "progress", "loss", "created")
    for job in items:
        sweep = job.get("sweep")
        table.add_row(
            str(job["id"]),
            job["name"] or "",
            job["state"],
            f"sweep of {sweep['children']}" if sweep else job["mode"],
            f"{_nodes(job)}×{job['gpus_per_node']}",
            _attempt(job),
            _percent(job),
            _number(job["progress"].get("loss")),
            job["created_at"][:19],
        )
    return table


def children_table(items: list[dict[str, Any]]) -> Table:
    """A sweep's children, oldest first, one column per varied path: the results side by side."""
    items = sorted(items, key=lambda j: j["id"])
    paths = list(dict.fromkeys(p for job in items for p in (job.get("sweep_point") or {})))
    leaves = [p.rsplit(".", 1)[-1] for p in paths]
    heads = leaves if len(set(leaves)) == len(leaves) else paths  # "lr", unless two paths end alike
    table = Table("id", *heads, "state", "progress", "loss", "val_loss", "val_acc")
    for job in items:
        point, p = job.get("sweep_point") or {}, job["progress"]
        table.add_row(
            str(job["id"]),
            *(str(point.get(path, "")) for path in paths),
            job["state"],
            _percent(job),
            _number(p.get("loss")),
            _number(p.get("val_loss")),
            _number(p.get("val_accuracy")),
        )
    return table
