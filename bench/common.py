"""What the benchmarks share: statistics, the result format, the machine, and real stacks.

A benchmark module writes one JSON result (`--json PATH`) that `bench.run` reads:

    {"name": ..., "title": ..., "figures": [Figure...], "details": "markdown", "notes": [...]}

A Figure compares what torchjobs does (`service`) against a floor measured in the same run
(`floor`), each as {"median", "min", "max", "n"}, and their ratio, computed per pair of runs
where the runs pair up (run i of the service against run i of the floor), else from the medians.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from service.testing import harness  # noqa: E402

# harness.make_env sets short test intervals; a benchmark runs with the product's defaults,
# because those are part of what a user waits for (e.g. the scheduler's pass interval).
TEST_ONLY_SETTINGS = (
    "TORCHJOBS_HEARTBEAT_INTERVAL_S",
    "TORCHJOBS_HEARTBEAT_TIMEOUT_S",
    "TORCHJOBS_CANCEL_GRACE_S",
    "TORCHJOBS_SCHEDULER_INTERVAL_S",
    "TORCHJOBS_SCHEDULER_IDLE_INTERVAL_S",
)
BENCH_REDIS_URL = os.environ.get("TORCHJOBS_BENCH_REDIS", f"{harness.REDIS_URL}/13")


# ------------------------------------------------------------------------------------------ statistics


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min, max and count of the values that are there (None: a run that gave no figure)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def paired_interval(service: Sequence[float], floor: Sequence[float], resamples: int = 20_000) -> str:
    """The per-pair ratios' median and geometric mean, each with a bootstrap 95% interval: on a
    noisy machine, what the pairs can and cannot tell apart (a fixed seed: the same text for
    the same runs)."""
    ratios = [s / f for s, f in zip(service, floor, strict=True) if s and f]
    if len(ratios) < 2:
        return ""
    rng = random.Random(0)

    def bounds(stat: Callable[[list[float]], float]) -> tuple[float, float]:
        draws = sorted(stat(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
        return draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]

    med, geo = bounds(statistics.median), bounds(statistics.geometric_mean)
    return (
        f"{len(ratios)} pairs: median ratio {statistics.median(ratios):.3f} "
        f"(bootstrap 95% {med[0]:.3f}–{med[1]:.3f}), geometric mean "
        f"{statistics.geometric_mean(ratios):.3f} ({geo[0]:.3f}–{geo[1]:.3f})"
    )


def figure(
    measure: str,
    unit: str,
    service: Sequence[float],
    floor: Sequence[float] | None = None,
    *,
    setup: str = "",
    floor_name: str = "",
    target: str = "",
    paired: bool = True,
    note: str = "",
) -> dict[str, Any]:
    """One row of the summary: the service's runs, the floor's runs, and their ratio."""
    fig: dict[str, Any] = {
        "measure": measure,
        "setup": setup,
        "unit": unit,
        "service": summary(service),
        "floor_name": floor_name,
        "floor": summary(floor) if floor is not None else None,
        "ratio": None,
        "target": target,
        "note": note,
    }
    if floor:
        if paired and len(floor) == len(service) and all(f for f in floor):
            fig["ratio"] = summary([s / f for s, f in zip(service, floor, strict=True)])
        elif fig["service"]["median"] is not None and fig["floor"]["median"]:
            r = fig["service"]["median"] / fig["floor"]["median"]
            fig["ratio"] = {"median": r, "min": None, "max": None, "n": 1}
    return fig


def fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "–"
    a = abs(value)
    if a >= 1000:
        text = f"{value:,.0f}"
    elif a >= 100:
        text = f"{value:.0f}"
    elif a >= 10:
        text = f"{value:.1f}"
    elif a >= 1:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3f}"
    return f"{text} {unit}".rstrip()


def fmt_range(s: dict[str, Any] | None, unit: str = "") -> str:
    """'median (min–max)', or just the median for a single value."""
    if not s or s.get("median") is None:
        return "–"
    if s.get("n", 0) > 1 and s.get("min") is not None:
        return f"{fmt(s['median'], unit)} ({fmt(s['min'])}–{fmt(s['max'])})"
    return fmt(s["median"], unit)


def write_result(path: str | Path | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2, default=str))


def print_figures(result: dict[str, Any]) -> None:
    print(f"\n{result['title']}")
    for f in result["figures"]:
        ratio = fmt_range(f["ratio"]) if f["ratio"] else "–"
        floor = fmt_range(f["floor"], f["unit"]) if f["floor"] else "–"
        print(
            f"  {f['measure']:<44} {f['setup']:<20} {fmt_range(f['service'], f['unit']):<26} "
            f"floor {floor:<26} ratio {ratio}"
        )


# ------------------------------------------------------------------------------------------ the machine


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "not available"


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if "model name" in line
        ),
        platform.processor() or "unknown",
    )
    mem_kb = next(
        (int(line.split()[1]) for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal")),
        0,
    )
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    try:
        import psycopg

        with psycopg.connect(harness.PG_ADMIN_URL, connect_timeout=5) as conn:
            pg = str(conn.execute("show server_version").fetchone()[0])  # type: ignore[index]
    except Exception:  # only a label
        pg = "not available"
    try:
        import redis

        rv = str(redis.Redis.from_url(harness.REDIS_URL, socket_timeout=5).info("server")["redis_version"])
    except Exception:  # only a label
        rv = "not available"
    commit = _version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "postgresql": pg,
        "redis": rv,
        "wrk": _version(["wrk", "-v"]).split(" [")[0].removeprefix("wrk ")
        if shutil.which("wrk")
        else "not installed",
        "commit": commit + (" (with uncommitted changes)" if dirty else ""),
        "loadavg": _read("/proc/loadavg").split()[:3],
    }


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


# ------------------------------------------------------------------------------------------ real stacks


def bench_env(home: Path, **overrides: str) -> dict[str, str]:
    env = harness.make_env(home, **overrides)
    for key in TEST_ONLY_SETTINGS:
        if key not in overrides:
            env.pop(key, None)
    return env


def fresh_redis() -> str:
    import redis

    redis.Redis.from_url(BENCH_REDIS_URL).flushdb()
    return BENCH_REDIS_URL


@contextlib.contextmanager
def workdir(prefix: str, keep_on_error: Path | None = None) -> Iterator[Path]:
    """A scratch folder, removed afterwards; on an error its *.log files go to `keep_on_error`."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        if keep_on_error is not None:
            keep_on_error.mkdir(parents=True, exist_ok=True)
            for log in path.rglob("*.log"):
                with contextlib.suppress(OSError):
                    shutil.copy(log, keep_on_error / f"{log.parent.name}-{log.name}")
        raise
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def embedded_stack(home: Path) -> Iterator[harness.Stack]:
    """`torchjobs up --gpus 2 --accelerator cpu`: SQLite, embedded broker, one local worker."""
    home.mkdir(parents=True, exist_ok=True)
    stack = harness.embedded_stack(home, bench_env(home))
    try:
        yield stack
    finally:
        stack.stop()


@contextlib.contextmanager
def production_stack(home: Path, workers: dict[str, int]) -> Iterator[tuple[harness.Stack, str]]:
    """`torchjobs db upgrade` + `server` + `worker --accelerator cpu --gpus N` per entry, on a
    fresh PostgreSQL database and the benchmark's Redis database. Yields (stack, database URL)."""
    home.mkdir(parents=True, exist_ok=True)
    pg_url = harness.create_pg_database()
    try:
        env = bench_env(
            home,
            TORCHJOBS_DATABASE_URL=pg_url,
            TORCHJOBS_BROKER_URL=fresh_redis(),
            TORCHJOBS_STORAGE_URL=f"file://{home / 'shared-storage'}",
        )
        subprocess.run(harness.torchjobs_cmd("db", "upgrade"), env=env, check=True, capture_output=True)
        stack = harness.Stack(home=home, env=env, port=harness.free_port(), embedded=False)
        try:
            stack.start_server()
            for name, gpus in workers.items():
                stack.start_worker(name, gpus)
            yield stack, pg_url
        finally:
            stack.stop()
    finally:
        harness.drop_pg_database(pg_url)


def all_events(stack: harness.Stack, job_id: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with stack.client() as c:
        while True:
            after = events[-1]["seq"] if events else 0
            page = c.get(f"/v1/jobs/{job_id}/events", params={"after": after}).json()["items"]
            if not page:
                return events
            events.extend(page)


def parse_ts(value: str) -> float:
    """An API timestamp (ISO 8601) as seconds since the epoch."""
    stamp = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return stamp.timestamp()


def failure_notes(label: str, runs: Sequence[dict[str, Any]]) -> list[str]:
    """A note per run that gave no figure, with its error's first line: a figure from fewer
    runs than asked says so."""
    notes = []
    for i, run in enumerate(runs):
        if "error" in run:
            text = run["error"].strip()
            first_line = text.splitlines()[0][:300] if text else "?"
            notes.append(f"FAILED: {label} run {i + 1}: {first_line}")
    return notes
