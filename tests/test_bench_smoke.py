"""The benchmark command's smoke run, as CI runs it: every benchmark once, briefly, on real stacks.

Nothing here asserts a timing: only that the command finishes, that every benchmark in it ran,
that it wrote its table under test-artifacts/, and that it left docs/benchmarks.md alone.
"""

from __future__ import annotations

import json
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
    "sandbox",
    "environment",
    "api",
    "scheduler",
    "sweep",
    "scale",
    "events",
    "checkpoint",
)


def _stat(path: Path) -> tuple[int, int] | None:
    return (path.stat().st_mtime_ns, path.stat().st_size) if path.exists() else None


@pytest.mark.timeout(840)
def test_bench_run_smoke() -> None:
    (SMOKE / "benchmarks.md").unlink(missing_ok=True)
    doc_before = _stat(DOC)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke"],
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
    assert set(ran) == set(BENCHMARKS)
    for name in BENCHMARKS:
        assert ran[name]["status"] == "ok", (name, ran[name].get("error_tail"))
        assert ran[name]["figures"], f"{name}: no figures in its output"
        assert f"| {name} |" in table
    assert "launch: POST -> first step" in proc.stdout  # the printed table of ratios
    assert _stat(DOC) == doc_before, "the smoke run must not touch docs/benchmarks.md"
