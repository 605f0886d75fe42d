"""Following a job as it runs: `watch` (its event stream, as a progress bar or JSON lines) and
`logs` (one rank's output, page by page or live)."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from service.client.api import TERMINAL, Client
from service.client.common import console
from service.states import JobState


def watch_job(client: Client, job_id: int, output: str) -> str:
    """Follow the job's event stream (it resumes by itself after a dropped connection) until
    the terminal state event; a progress bar on the terminal, one JSON event a line with -o json."""
    job = client.get(job_id)
    if output == "json":
        for event in client.stream_events(job_id):
            typer.echo(json.dumps(event))
        return client.get(job_id)["state"]
    columns = (
        TextColumn("[bold]job {task.fields[job]}[/bold] {task.fields[state]:<10}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TextColumn(
            "epoch {task.fields[epoch]} step {task.fields[step]} loss {task.fields[loss]} "
            "{task.fields[sps]} samples/s"
        ),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        fields: dict[str, Any] = _progress_fields(job["progress"])
        task = bar.add_task("", total=1.0, job=job_id, state=job["state"], **fields)
        bar.update(task, completed=job["progress"].get("fraction") or 0.0)
        for event in client.stream_events(job_id):
            if event["type"] == "state":
                bar.update(task, state=event["data"]["state"])
            elif event["type"] == "progress":
                d = event["data"]
                fraction = _fraction(d)
                update: dict[str, Any] = _progress_fields(d)
                bar.update(task, **update)
                if fraction is not None:
                    bar.update(task, completed=fraction)
        final = client.get(job_id)
        if final["state"] == JobState.SUCCEEDED:
            bar.update(task, completed=1.0)
    console.print(f"job {job_id} {final['state']}" + (f": {final['error']}" if final.get("error") else ""))
    return final["state"]


def _fraction(d: dict[str, Any]) -> float | None:
    if d.get("total_steps") and d.get("step") is not None:
        return min(1.0, d["step"] / d["total_steps"])
    if d.get("epochs") and d.get("epoch") is not None:
        return min(1.0, d["epoch"] / d["epochs"])
    return None


def _progress_fields(d: dict[str, Any]) -> dict[str, str]:
    def num(value: Any, fmt: str = "g") -> str:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "-"
        return format(value, fmt)

    def of(done: str, total: str) -> str:
        return f"{num(d.get(done))}/{num(d.get(total))}" if d.get(total) else num(d.get(done))

    return {
        "epoch": of("epoch", "epochs"),
        "step": of("step", "total_steps"),
        "loss": num(d.get("loss"), ".4f"),
        "sps": num(d.get("samples_per_sec"), ".0f"),
    }


def print_logs(client: Client, job_id: int, node: int, rank: int, attempt: int | None, follow: bool) -> None:
    """Without -f: every byte stored so far, page by page (byte-exact). With -f: the live log
    stream, which resumes at the right offset after a dropped connection; when the attempt ends
    and the job is retried, it goes on with the next attempt (unless --attempt pinned one)."""
    out = sys.stdout
    if not follow:
        offset = 0
        while True:
            data, nxt, attempt = client.logs_page(job_id, node, rank, offset, attempt)
            if not data:
                return
            out.buffer.write(data)
            out.buffer.flush()
            offset = nxt
    pinned = attempt is not None
    while True:
        end: dict[str, Any] = {}
        for message in client.stream_logs(job_id, node, rank, 0, attempt):
            if message["type"] == "end":
                end = message
                break
            out.write(message["data"])
            out.flush()
        if pinned or end.get("state") is None or end["state"] in TERMINAL:
            return
        attempt = int(end["attempt"]) + 1  # the attempt ended and the job was queued again
        console.print(f"[dim]--- attempt {attempt - 1} ended; following attempt {attempt} ---[/dim]")
