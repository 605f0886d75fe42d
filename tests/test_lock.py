"""The pinned installs of .ci/setup (.ci/lock/*.txt) agree with pyproject.toml: every
dependency is pinned to a version its range allows, torch is left to pip (the local CPU
build), and nothing of CUDA slipped in. Offline: it reads files only; `uv pip check` in
.ci/setup proves the installed set whole."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def pins(name: str) -> dict[str, str]:
    out = {}
    for line in (REPO / ".ci" / "lock" / name).read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            out[canonicalize_name(req.name)] = spec.version
    return out


@pytest.mark.parametrize(
    ("lock", "deps"),
    [
        ("runtime.txt", PROJECT["dependencies"]),
        ("dev.txt", PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"]),
    ],
)
def test_each_dependency_is_pinned_inside_its_range(lock: str, deps: list[str]) -> None:
    pinned = pins(lock)
    for dep in deps:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name not in pinned  # pip installs the local CPU build first
            continue
        assert name in pinned, f"{dep} is not in .ci/lock/{lock}: run bash .ci/lock/update"
        assert req.specifier.contains(pinned[name], prereleases=True), (dep, pinned[name])


def test_no_cuda_build_is_pinned() -> None:
    for lock in ("runtime.txt", "dev.txt"):
        names = pins(lock)
        assert not [n for n in names if n.startswith(("nvidia-", "cuda-")) or n == "triton"], lock


def test_the_runtime_lock_leaves_the_dev_tools_out() -> None:
    runtime = pins("runtime.txt")
    for heavy in ("moto", "boto3", "playwright", "schemathesis", "pytest", "mypy"):
        assert heavy not in runtime
