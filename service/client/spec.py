"""A job spec from the command line: a YAML file, `--set key=value`, flags, `--depends-on`
and `--sweep`, read as the person who wrote them meant them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer
import yaml


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
    return yaml.load(text, Loader=SpecLoader)  # safe: SpecLoader is a SafeLoader subclass


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
