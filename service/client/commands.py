"""Client commands over the REST API: submit, ls, show, watch, logs, cancel, checkpoints, download, upload.

Every command takes `--output json` for scripts. `watch` exits 0 when the job succeeded,
1 when it failed and 3 when it was cancelled; API errors exit 2 with the server's reason.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from service.client.api import TERMINAL, ApiError, Client
from service.client.download import ChecksumMismatch
from service.config import Settings
from service.states import JobState

console = Console(stderr=True)
OutputOpt = Annotated[str, typer.Option("--output", "-o", help="table | json")]
# `download` keeps -o for the destination file (contract: `download CKPT [-o PATH]`).
OutputLongOpt = Annotated[str, typer.Option("--output", help="table | json")]
UrlOpt = Annotated[str | None, typer.Option("--url", help="server URL (TORCHJOBS_URL)")]
TokenOpt = Annotated[str | None, typer.Option("--token", help="bearer token (TORCHJOBS_TOKEN)")]
EXIT_BY_STATE = {JobState.SUCCEEDED: 0, JobState.FAILED: 1, JobState.CANCELLED: 3}


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
    settings = Settings()
    token = token or settings.token or settings.admin_token
    if token is None and settings.admin_token_file.exists():
        token = settings.admin_token_file.read_text().strip()
    return Client(url or settings.url, token)


def _push(client: Client, folder: Path, name: str | None = None) -> dict[str, Any]:
    try:
        return client.push_code(folder, name)
    except OSError as exc:
        console.print(f"[red]error[/red] {folder}: {exc}")
        raise typer.Exit(2) from None


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


def set_path(spec: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = spec
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


class SpecLoader(yaml.SafeLoader):
    """YAML 1.1 (PyYAML) reads `lr: 1e-3` as the string "1e-3" (a float needs a dot there); a
    spec file means the number, as YAML 1.2 and JSON do."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=SpecLoader)  # noqa: S506 - a SafeLoader subclass


def _text(value: Any) -> Any:
    """A YAML scalar as the text it was written as: `1` and `true` unquoted are not strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value


def scalars_as_text(spec: dict[str, Any]) -> None:
    """`env: {OMP_NUM_THREADS: 1}`, `labels: {v: 2}` and `args: [--epochs, 2]` in YAML hold
    numbers; the ranks' environment, labels and a script's argv are text."""
    for field in ("env", "labels"):
        mapping = spec.get(field)
        if isinstance(mapping, dict):
            for key, value in mapping.items():
                mapping[key] = _text(value)
    entrypoint = spec.get("entrypoint")
    if isinstance(entrypoint, dict) and isinstance(entrypoint.get("args"), list):
        entrypoint["args"] = [_text(a) for a in entrypoint["args"]]


def build_spec(file: Path | None, sets: list[str], flags: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = load_yaml(file.read_text()) if file else {}
    if not isinstance(spec, dict):
        raise typer.BadParameter("the spec file must hold a mapping")
    for key, value in flags.items():
        if value is not None:
            set_path(spec, key, value)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set takes key=value, got {item!r}")
        set_path(spec, key.strip(), load_yaml(raw))
    scalars_as_text(spec)
    spec.setdefault("entrypoint", {"kind": "builtin", "model": "cnn", "dataset": "digits"})
    spec.setdefault("mode", "single")
    return spec


def parse_dependency(text: str) -> dict[str, Any]:
    """`12` waits for job 12 to succeed; `12:ended` for it to end in any way."""
    job, _, condition = text.partition(":")
    if not job.strip().isdigit() or condition not in ("", "succeeded", "ended"):
        raise typer.BadParameter(f"--depends-on takes JOB_ID or JOB_ID:ended, got {text!r}")
    return {"job_id": int(job), "condition": condition or "succeeded"}


def _percent(job: dict[str, Any]) -> str:
    p = job["progress"]
    return f"{p['fraction'] * 100:.0f}%" if p.get("fraction") is not None else ""


def _number(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else ""


def jobs_table(items: list[dict[str, Any]]) -> Table:
    table = Table("id", "name", "state", "mode", "nodes×gpus", "progress", "loss", "created")
    for job in items:
        sweep = job.get("sweep")
        table.add_row(
            str(job["id"]),
            job["name"] or "",
            job["state"],
            f"sweep of {sweep['children']}" if sweep else job["mode"],
            f"{job['nodes']}×{job['gpus_per_node']}",
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


def parse_sweep(items: list[str], max_parallel: int | None) -> dict[str, Any]:
    """`--sweep 'hyperparameters.lr=0.1,0.01'` (repeatable): one axis of the grid each, the
    values read as YAML scalars (`0.1` a number, `adamw` a string)."""
    grid: dict[str, Any] = {}
    for item in items:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip() or not raw.strip():
            raise typer.BadParameter(f"--sweep takes PATH=V1,V2,..., got {item!r}")
        path = path.strip()
        as_text = path.startswith(("env.", "labels."))  # their values are strings, whatever they look like
        grid[path] = [v.strip() if as_text else load_yaml(v.strip()) for v in raw.split(",")]
    sweep: dict[str, Any] = {"grid": grid}
    if max_parallel is not None:
        sweep["max_parallel"] = max_parallel
    return sweep


def register(app: typer.Typer) -> None:  # noqa: C901 - a flat list of small commands
    @app.command()
    def submit(
        file: Annotated[
            Path | None, typer.Argument(help="job spec YAML", exists=True, dir_okay=False)
        ] = None,
        set_: Annotated[list[str] | None, typer.Option("--set", help="key=value override")] = None,
        mode: Annotated[str | None, typer.Option()] = None,
        nodes: Annotated[int | None, typer.Option()] = None,
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
            "nodes": nodes,
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
                spec["code"] = _push(client, workdir)["id"]
            job = client.submit(spec)
        if output == "json":
            emit(job, output)
        else:
            typer.echo(job["id"])

    code_app = typer.Typer(
        help="Your own code: upload a folder, list what you uploaded.", no_args_is_help=True
    )
    app.add_typer(code_app, name="code")

    @code_app.command("push")
    def code_push(
        folder: Annotated[Path, typer.Argument(help="the folder to pack", exists=True, file_okay=False)],
        name: Annotated[str | None, typer.Option(help="default: the folder's name")] = None,
        url: UrlOpt = None,
        token: TokenOpt = None,
        output: OutputOpt = "table",
    ) -> None:
        """Pack and upload a folder (unless the server has it already); prints the code id."""
        with api(url, token) as client:
            code = _push(client, folder, name)
        emit(code, output) if output == "json" else typer.echo(code["id"])

    @code_app.command("ls")
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

    @app.command("ls")
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

    @app.command()
    def show(job_id: int, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "json") -> None:
        """Show one job."""
        with api(url, token) as client:
            emit(client.get(job_id), output)

    @app.command()
    def watch(job_id: int, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table") -> None:
        """Follow a job live until it ends; the exit code says how it ended."""
        with api(url, token) as client:
            final = _watch(client, job_id, output)
        raise typer.Exit(EXIT_BY_STATE.get(JobState(final), 1))

    @app.command()
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
            _logs(client, job_id, node, rank, attempt, follow)

    @app.command()
    def cancel(job_id: int, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table") -> None:
        """Cancel a job (harmless if it is already cancelling or cancelled)."""
        with api(url, token) as client:
            job = client.cancel(job_id)
        emit(job, output) if output == "json" else typer.echo(job["state"])

    @app.command()
    def checkpoints(
        job_id: int, url: UrlOpt = None, token: TokenOpt = None, output: OutputOpt = "table"
    ) -> None:
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

    @app.command()
    def download(
        ckpt_id: int,
        out: Annotated[Path | None, typer.Option("-o", "--out", help="destination file")] = None,
        url: UrlOpt = None,
        token: TokenOpt = None,
        output: OutputLongOpt = "table",
    ) -> None:
        """Download a checkpoint with a progress bar; resumes and verifies its SHA-256."""
        with api(url, token) as client:
            try:
                meta = client.checkpoint(ckpt_id)
                dest = str(out or meta["name"])
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
                console.print(f"[red]error[/red]: {exc}; nothing was kept")
                raise typer.Exit(1) from None
            except httpx.TransportError as exc:
                console.print(f"[red]error[/red]: {exc!r}; run the same command again to resume")
                raise typer.Exit(1) from None
        result = {"id": ckpt_id, "path": dest, "sha256": sha, "verified": True}
        emit(result, output) if output == "json" else typer.echo(f"{dest} sha256 {sha} verified")

    @app.command()
    def upload(
        path: Annotated[Path, typer.Argument(exists=True, dir_okay=False)],
        name: Annotated[str | None, typer.Option()] = None,
        url: UrlOpt = None,
        token: TokenOpt = None,
        output: OutputOpt = "table",
    ) -> None:
        """Upload your own checkpoint to resume from."""
        with api(url, token) as client:
            ckpt = client.upload(str(path), name)
        emit(ckpt, output) if output == "json" else typer.echo(ckpt["id"])


def _watch(client: Client, job_id: int, output: str) -> str:
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


def _logs(client: Client, job_id: int, node: int, rank: int, attempt: int | None, follow: bool) -> None:
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
