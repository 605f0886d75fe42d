"""Metric series (contract §13): every number a rank reports is a point of a named series.

Written in the report's own transaction (`service.jobs.reports.write_batch`), under the job's
row lock that the events' append took: one `metric_points` row per report (its numbers as one
JSON object, keyed by the job and the event's `seq`), the job's new names into
`metric_names`, and a sweep child's last value of its objective onto its own row. Read as one
range of the primary key; without `names`, each point's JSON is spliced in as stored, never
parsed, so a job of 100,000 reports answers in a fraction of a second.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from service.jobs import repository as repo
from service.models import utcnow

NOT_SERIES = frozenset({"step", "epoch", "fraction", "reported_at", "ts", "type"})  # a point's own
MAX_NAMES_PER_JOB = 1000  # past it a job's new names are not kept (its known ones still are)
MAX_NAME = 64
INT32 = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Recorded:
    """What a batch's metrics told of the job: its parent, and whether its objective moved
    (then the sweep's best and rungs are looked at), and a stop asked of it."""

    parent_id: int | None
    objective_moved: bool
    stop_intent: str | None


def series_values(event: dict[str, Any]) -> dict[str, float]:
    """The report's numbers by name: finite ints and floats (not booleans), under names the
    database stores (no control character, no lone surrogate). Anything else is no series."""
    out: dict[str, float] = {}
    for name, value in event.items():
        if name in NOT_SERIES or not _storable_name(name):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        try:
            number = float(value)
        except OverflowError:
            continue
        if math.isfinite(number):
            out[name] = number
    return out


def _storable_name(name: Any) -> bool:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        return False
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _int_or_none(value: Any) -> int | None:
    """A point's `step` or `epoch`: an integer the column holds (2.0 is 2), else none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and -INT32 <= value <= INT32 else None


def record(
    session: Session, job_id: int, attempt: int, first_seq: int, events: Sequence[dict[str, Any]]
) -> Recorded:
    """The points of `events` (progress events numbered from `first_seq`), in the caller's
    transaction, which holds the job's row lock."""
    job = repo.objective_facts(session, job_id)
    if job is None:
        return Recorded(None, False, None)
    metric = (job.objective or {}).get("metric")
    now = utcnow()
    rows: list[dict[str, Any]] = []
    names: set[str] = set()
    last_objective: tuple[float, int | None] | None = None
    for i, event in enumerate(events):
        values = series_values(event)
        if not values:
            continue
        names.update(values)
        epoch = _int_or_none(event.get("epoch"))
        objective = values.get(metric) if metric else None
        if objective is not None:
            last_objective = (objective, epoch)
        rows.append(
            {
                "job_id": job_id,
                "seq": first_seq + i,
                "attempt": attempt,
                "step": _int_or_none(event.get("step")),
                "epoch": epoch,
                "ts": now,
                "values": values,
                "objective": objective,
            }
        )
    if not rows:
        return Recorded(job.parent_id, False, job.stop_intent)
    repo.add_metric_points(session, rows)
    _add_names(session, job_id, names)
    if last_objective is not None:
        repo.set_objective_value(session, job_id, *last_objective)
    return Recorded(job.parent_id, last_objective is not None, job.stop_intent)


def _add_names(session: Session, job_id: int, names: set[str]) -> None:
    """Only the names the job has not reported before (under its row lock: no race)."""
    known = repo.known_metric_names(session, job_id)
    fresh = sorted(names - known)[: max(0, MAX_NAMES_PER_JOB - len(known))]
    if fresh:
        repo.add_metric_names(session, job_id, fresh)


def job_names(session: Session, job_id: int) -> list[str]:
    return repo.metric_names(session, job_id)


def parse_names(raw: str | None) -> list[str] | None:
    """`?names=a,b`: the names asked for, in order, once each; None (or blank) is every name."""
    names = list(dict.fromkeys(n.strip() for n in (raw or "").split(",") if n.strip()))
    return names or None


MAX_EXTRACTED = 32  # asked for more names than this, the points are parsed here instead


def series_json(session: Session, job_id: int, names: list[str] | None) -> bytes:
    """`{"names": [...], "series": [{"step","epoch","ts",name: value...}...]}` as bytes. With
    `names`, only those (an unknown name is simply absent) and only points holding one:
    PostgreSQL builds those points itself from its jsonb (`repo.series_text_pg`); SQLite
    extracts the values (`json_extract`) and they are formatted here."""
    all_names = job_names(session, job_id)
    if not all_names:
        return _from_events(session, job_id, names)
    known = set(all_names)
    wanted = None if names is None else [n for n in names if n in known]
    head = json.dumps({"names": all_names}, separators=(",", ":"))[:-1]
    if wanted and session.get_bind().dialect.name == "postgresql":
        return (head + ',"series":[' + repo.series_text_pg(session, job_id, wanted) + "]}").encode()
    if wanted is None or len(wanted) > MAX_EXTRACTED or not all(map(_plain, wanted)):
        rows = repo.metric_points_as_text(session, job_id)
        points = ((r[0], r[1], r[2], r[3]) for r in rows)
        parts = _spliced(points) if wanted is None else _filtered(points, wanted)
    else:
        parts = _extracted(session, job_id, wanted)
    return (head + ',"series":[' + ",".join(parts) + "]}").encode()


def _plain(name: str) -> bool:
    """A name the database's JSON path takes as it is (SQLite's `$."name"` has no escape for
    a quote or a backslash, and compares a stored `\\u00fc` escape as it is): printable ASCII
    without those. Any other is picked out of the parsed points instead."""
    return name.isascii() and name.isprintable() and '"' not in name and "\\" not in name


def _from_events(session: Session, job_id: int, names: list[str] | None) -> bytes:
    """A job that ran before series were stored (migration 0015) has only its progress
    events: its series are read from them (such a job is small: it ran on the old version)."""
    points: list[dict[str, Any]] = []
    seen: set[str] = set()
    for event in repo.progress_events(session, job_id):
        values = series_values(event.data)
        seen.update(values)
        if names is not None:
            values = {n: values[n] for n in names if n in values}
        if values:
            data = event.data
            points.append(
                {
                    "step": _int_or_none(data.get("step")),
                    "epoch": _int_or_none(data.get("epoch")),
                    "ts": event.ts.isoformat(),
                    **values,
                }
            )
    return json.dumps({"names": sorted(seen), "series": points}, separators=(",", ":")).encode()


def _point_head(step: int | None, epoch: int | None, ts: datetime) -> str:
    return (
        f'{{"step":{"null" if step is None else step},"epoch":{"null" if epoch is None else epoch},'
        f'"ts":"{_iso(ts)}"'
    )


@functools.lru_cache(maxsize=64)
def _iso(ts: datetime) -> str:
    """A batch's points share their `ts`: formatted once, not once a point."""
    return ts.isoformat()


def _spliced(rows: Iterable[tuple[int | None, int | None, datetime, str]]) -> Iterable[str]:
    """Each stored object's members after the point's own, as stored: the JSON was written
    by `json.dumps` of finite numbers under checked names, so it is spliced, not parsed."""
    for step, epoch, ts, values in rows:
        body = values.strip()[1:-1].strip()
        yield _point_head(step, epoch, ts) + ("," + body if body else "") + "}"


def _extracted(session: Session, job_id: int, wanted: list[str]) -> Iterable[str]:
    if not wanted:
        return
    keys = [json.dumps(name) + ":" for name in wanted]
    rows = repo.extracted_metric_points(session, job_id, wanted)
    for row in rows:
        picked = ",".join(key + repr(float(v)) for key, v in zip(keys, row[3:], strict=True) if v is not None)
        yield _point_head(row[0], row[1], row[2]) + "," + picked + "}"


def _filtered(
    rows: Iterable[tuple[int | None, int | None, datetime, str]], wanted: list[str]
) -> Iterable[str]:
    if not wanted:
        return
    for step, epoch, ts, values in rows:
        stored = json.loads(values)
        picked = {n: stored[n] for n in wanted if n in stored}
        if picked:
            yield _point_head(step, epoch, ts) + "," + json.dumps(picked, separators=(",", ":"))[1:]
