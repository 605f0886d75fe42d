"""The benchmark command's smoke run, on real stacks: per commit, every benchmark is imported
and the cheapest one runs through `bench.run --smoke`; `bash .ci/bench-smoke` runs them all
(TORCHJOBS_BENCH_SMOKE=all), about 5 minutes here, before figures are regenerated.

Nothing here asserts a timing: only that the command finishes, that every benchmark asked for
ran, that it wrote its table under test-artifacts/, and that it left docs/benchmarks.md alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "test-artifacts" / "bench" / "smoke"
DOC = REPO / "docs" / "benchmarks.md"
BENCHMARKS = (
    "trainer",
    "trainer-bf16",
    "trainer-compile",
    "launch",
    "warm_launch",
    "sandbox",
    "environment",
    "api",
    "submit",
    "metrics",
    "scheduler",
    "sweep",
    "asha",
    "resize",
    "scale",
    "events",
    "checkpoint",
    "fsdp-checkpoint",
    "folder-checkpoint",
    "mesh",
)
CHEAPEST = ("trainer",)  # 7 s of the smoke's ~280 s here
RUN = BENCHMARKS if os.environ.get("TORCHJOBS_BENCH_SMOKE") == "all" else CHEAPEST


def _stat(path: Path) -> tuple[int, int] | None:
    return (path.stat().st_mtime_ns, path.stat().st_size) if path.exists() else None


def test_every_benchmark_is_listed_and_its_program_imports() -> None:
    """What the per-commit run leaves out still cannot rot unseen: each benchmark's program
    is imported (a fresh interpreter: no import made by another test hides a broken one)."""
    from bench.run import BENCHMARKS as LISTED

    assert tuple(b.name for b in LISTED) == BENCHMARKS
    modules = sorted({_module_of(b.smoke) for b in LISTED})
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\nprint('ok')"
    proc = subprocess.run(
        [sys.executable, "-c", code, *modules], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]


def _module_of(argv: list[str]) -> str:
    """`python -m bench.x ...` -> bench.x; `python bench/x.py ...` -> bench.x."""
    if argv[1] == "-m":
        return argv[2]
    return argv[1].removesuffix(".py").replace("/", ".")


@pytest.mark.timeout(840)
def test_bench_run_smoke() -> None:
    (SMOKE / "benchmarks.md").unlink(missing_ok=True)
    doc_before = _stat(DOC)
    only = [] if RUN == BENCHMARKS else ["--only", *RUN]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", *only],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=780,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"

    table = (SMOKE / "benchmarks.md").read_text()
    assert "## Summary" in table and "## Machine" in table
    results = json.loads((SMOKE / "benchmarks.json").read_text())
    ran = {e["name"]: e for e in results["benchmarks"]}
    assert set(ran) == set(RUN)
    for name in RUN:
        assert ran[name]["status"] == "ok", (name, ran[name].get("error_tail"))
        assert ran[name]["figures"], f"{name}: no figures in its output"
        assert f"| {name} |" in table
    if "launch" in RUN:
        assert "launch: POST -> first step" in proc.stdout  # the printed table of ratios
    assert _stat(DOC) == doc_before, "the smoke run must not touch docs/benchmarks.md"
