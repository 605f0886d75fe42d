"""Metric commands (contract §13): `metrics` (a job's series, as a table, CSV or JSON) and
`tensorboard` (jobs' series as TensorBoard event files, one run folder per job)."""

from __future__ import annotations

import csv
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from service.client.api import Client
from service.client.common import OutputOpt, TokenOpt, UrlOpt, api, console, emit

NamesOpt = Annotated[str | None, typer.Option("--names", help="comma-separated series: only those")]


def register(app: typer.Typer) -> None:
    app.command()(metrics)
    app.command()(tensorboard)


def metrics(
    job_id: int,
    names: NamesOpt = None,
    as_csv: Annotated[
        bool, typer.Option("--csv", help="CSV on stdout: step, epoch, ts, one column per series")
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    output: OutputOpt = "table",
) -> None:
    """A job's metric series: every number its ranks reported, by step."""
    with api(url, token) as client:
        got = client.metrics(job_id, names)
    if output == "json":
        emit(got, output)
        return
    columns = series_columns(got, names)
    if as_csv:
        write_csv(got["series"], columns)
        return
    table = Table("step", "epoch", "ts", *columns)
    for point in got["series"]:
        table.add_row(
            *(_cell(point.get(k)) for k in ("step", "epoch")),
            str(point.get("ts", ""))[:19],
            *(_cell(point.get(name)) for name in columns),
        )
    Console().print(table)


def series_columns(got: dict[str, Any], names: str | None) -> list[str]:
    """The asked names in their order (those the job has), else every name the job reported."""
    known = list(got.get("names") or [])
    if not names:
        return known
    asked = [n.strip() for n in names.split(",") if n.strip()]
    return [n for n in dict.fromkeys(asked) if n in known]


def write_csv(series: list[dict[str, Any]], columns: list[str]) -> None:
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(["step", "epoch", "ts", *columns])
    for point in series:
        out.writerow([_csv(point.get(k)) for k in ("step", "epoch", "ts", *columns)])


def _csv(value: Any) -> str:
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def tensorboard(
    job_ids: Annotated[list[int], typer.Argument(help="jobs (a sweep: each of its children)")],
    logdir: Annotated[Path, typer.Option("--logdir", help="where the run folders go (created)")],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Write each job's series as TensorBoard event files: one run folder per job, a sweep's
    children named by their point. Then: `tensorboard --logdir DIR`."""
    with api(url, token) as client:
        jobs = _expand(client, job_ids)
        used: set[str] = set()
        for job in jobs:
            folder = unique_folder(run_name(job), job["id"], used)
            points = write_run(logdir / folder, client.metrics(job["id"])["series"])
            console.print(f"job {job['id']}: {points} points -> {logdir / folder}")


def _expand(client: Client, job_ids: list[int]) -> list[dict[str, Any]]:
    """The jobs, a sweep's parent replaced by its children (in id order)."""
    out: list[dict[str, Any]] = []
    for job_id in job_ids:
        job = client.get(job_id)
        if job.get("kind") != "sweep":
            out.append(job)
            continue
        children: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = client.list(parent=job_id, limit=500, cursor=cursor)
            children.extend(page["items"])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        out.extend(sorted(children, key=lambda j: j["id"]))
    return out


def run_name(job: dict[str, Any]) -> str:
    """A sweep child's point (`lr=0.1,seed=0`, by each path's last part), else `job-ID` (and
    its name); only characters safe in a folder name on every system."""
    point = job.get("sweep_point")
    if point:
        raw = ",".join(f"{str(path).rsplit('.', 1)[-1]}={value}" for path, value in point.items())
    else:
        raw = f"job-{job['id']}" + (f"-{job['name']}" if job.get("name") else "")
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", raw).strip(".")[:120]
    return name or f"job-{job['id']}"


def unique_folder(name: str, job_id: int, used: set[str]) -> str:
    folder = name if name not in used else f"{name}-job{job_id}"
    used.add(folder)
    return folder


def write_run(folder: Path, series: list[dict[str, Any]]) -> int:
    """One event file of scalars, by torch's TensorBoard writer (the `tensorboard` extra); a
    point without a step takes its place in the series."""
    writer = _summary_writer()(log_dir=str(folder))  # it makes the folder
    try:
        for i, point in enumerate(series):
            step = point.get("step")
            wall_time = _wall_time(point.get("ts"))
            for name, value in sorted(point.items()):
                if name in ("step", "epoch", "ts") or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)):
                    writer.add_scalar(name, float(value), step if isinstance(step, int) else i, wall_time)
    finally:
        writer.close()
    return len(series)


def _summary_writer() -> Any:
    """torch.utils.tensorboard's SummaryWriter; without the `tensorboard` package a clear
    exit, not a traceback."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        console.print(
            "[red]error:[/red] `torchjobs tensorboard` writes with the tensorboard package: "
            "pip install 'torchjobs[tensorboard]' (or tensorboard>=2.18)"
        )
        raise typer.Exit(2) from None
    return SummaryWriter


def _wall_time(ts: Any) -> float:
    try:
        return datetime.fromisoformat(str(ts)).timestamp()
    except ValueError:
        return 0.0
