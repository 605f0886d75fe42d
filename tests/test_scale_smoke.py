"""The scale simulator's smoke run (bench/scale.py: 10 simulated hosts, 20 jobs) in the normal
suite, so that it cannot rot: it registers, beats, claims, reports and ends nodes through the
product's worker-side functions against a real server on PostgreSQL + Redis, and its clients
poll, list, submit and stream. No timing is asserted: only that every part did its work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_the_simulator_smoke_run_completes(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--smoke", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["hosts"] == 10 and row["claims"] >= 10 and row["batches_per_s"] > 0, row
    assert row["passes"] > 0 and row["pass_mean_s"] is not None
    assert row["get_p50_s"] is not None and row["post_p50_s"] is not None and row["list_p50_s"] is not None
    assert row["lag_samples"] > 0 and row["client_failures"] == 0, row
    assert row["false_offline"] == 0 and row["lost_nodes"] == 0 and row["errors"] == [], row
    assert "| hosts | running |" in proc.stdout
