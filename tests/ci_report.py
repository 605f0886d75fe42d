"""The suite's time per test folder, printed at the end of every run, with a warning once the
whole CI run (both tiers of `.ci/test`) passes 40 minutes: CI's budget is 90, the team's bar 30,
and a suite that creeps up is seen in the run that made it creep, not a week later.

Each run also writes its time per module to `test-artifacts/module-seconds-<tier>.json`;
both tiers' files, merged, are `tests/module_seconds.json`, which orders the modules longest
first (tests/conftest.py). It was taken out while xdist's groups were not honoured (that order
then put the same heavy module's tests on both processes at once, each building the module's
stack); `ModuleGroupScheduling` keeps a module on one process, and the file is back, from
the CI run of 44d8547 (2026-12-07, Intel Xeon, 2 cores, two test processes; the order is what
counts). Refresh it when modules are added or grow, or when a change moves a module's cost
(that run made the one-test stacks of six modules cold: their order changed)."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import PurePosixPath

import pytest

WARN_AFTER_S = 40 * 60
_totals: dict[str, float] = defaultdict(float)
_counts: dict[str, int] = defaultdict(int)
_modules: dict[str, float] = defaultdict(float)
_session_started = time.time()


def folder_of(nodeid: str) -> str:
    """`tests/service/jobs/test_x.py::test_y` -> `tests/service/jobs` (three levels at most)."""
    parts = PurePosixPath(nodeid.split("::")[0]).parts[:-1]
    return "/".join(parts[:3]) or "."


def ci_started_at() -> float:
    """When `.ci/test` began (it exports the epoch), else when this pytest began."""
    try:
        return float(os.environ["TORCHJOBS_CI_STARTED"])
    except (KeyError, ValueError):
        return _session_started


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    folder = folder_of(report.nodeid)
    _totals[folder] += report.duration
    _modules[report.nodeid.split("::")[0].removeprefix("tests/")] += report.duration
    if report.when == "call":
        _counts[folder] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _totals:
        return
    terminalreporter.section("time per folder (setup + call + teardown)")
    for folder, seconds in sorted(_totals.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {_counts[folder]:5d} tests  {folder}")
    terminalreporter.write_line(f"{sum(_totals.values()):8.1f} s  in all")
    _write_module_seconds(terminalreporter.config)
    elapsed = time.time() - ci_started_at()
    if elapsed > WARN_AFTER_S:
        terminalreporter.write_line(
            f"WARNING: the CI run has taken {elapsed / 60:.1f} min, past its {WARN_AFTER_S // 60}-minute "
            "warning line: see the slowest tests above",
            red=True,
            bold=True,
        )


def _write_module_seconds(config: pytest.Config) -> None:
    """Only a run of a whole tier (`-m` given, no paths, no `-k`): a partial run's figures
    would replace a module's with a few of its tests'."""
    marker = config.getoption("markexpr", "")
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("keyword", "")
    if not marker or not whole:
        return
    tier = "marked" if not marker.startswith("not") else "fast"
    folder = config.rootpath / "test-artifacts"
    folder.mkdir(exist_ok=True)
    ordered = dict(sorted(((k, round(v, 1)) for k, v in _modules.items()), key=lambda kv: -kv[1]))
    (folder / f"module-seconds-{tier}.json").write_text(json.dumps(ordered, indent=1) + "\n")
