"""The tiers of `.ci/test` stay true as the suite grows: a module that starts a torchjobs stack
is marked `stack` (else it would run in the fast tier, and with -x), and the table names only
modules that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import MARKS, TESTS

STARTS_A_STACK = re.compile(
    r"embedded_stack\(|production_stack\(|harness\.Stack\("
    r"|def \w+\([^)]*\b(embedded|production|emb|prod|ckpt_stack|walled|two_hosts)\b\s*:"
)


def unmarked_stack_modules(sources: dict[str, str]) -> list[str]:
    return sorted(
        key
        for key, source in sources.items()
        if STARTS_A_STACK.search(source) and "stack" not in MARKS.get(key, ())
    )


def _test_modules() -> dict[str, str]:
    return {
        path.relative_to(TESTS).as_posix(): path.read_text()
        for path in TESTS.rglob("test_*.py")
        if not path.relative_to(TESTS).as_posix().startswith("gpu/") and path.name != "test_tiers.py"
    }


def test_every_module_that_starts_a_stack_is_marked_stack() -> None:
    assert unmarked_stack_modules(_test_modules()) == []


def test_the_check_sees_an_unmarked_stack() -> None:
    planted = {
        "service/test_new.py": "def test_x(embedded: Stack) -> None: ...",
        "service/test_other.py": "s = harness.embedded_stack(home)",
        "service/test_plain.py": "def test_y(client) -> None: ...",
    }
    assert unmarked_stack_modules(planted) == ["service/test_new.py", "service/test_other.py"]


def test_the_table_names_only_modules_that_exist() -> None:
    assert [key for key in MARKS if not (TESTS / key).is_file()] == []


def test_the_markers_are_the_registered_ones() -> None:
    registered = {"stack", "torchrun", "browser", "bench", "fault"}
    assert {mark for marks in MARKS.values() for mark in marks} <= registered
    ci = (Path(TESTS).parent / ".ci" / "test").read_text()
    assert 'MARKED="stack or torchrun or browser or bench or fault"' in ci


def test_the_longest_groups_go_first_each_keeping_its_tests_in_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """xdist hands whole groups out in collection order: a long module must not come last."""
    from types import SimpleNamespace

    from tests import conftest

    def item(key: str, name: str) -> SimpleNamespace:
        return SimpleNamespace(path=TESTS / key, name=name)

    items = [
        item("service/test_a.py", "a1"),
        item("service/test_a.py", "a2"),
        item("integration/test_multinode.py", "m1"),
        item("integration/test_multinode.py", "m2"),
        item("service/streams/test_logs.py", "s1"),  # the fixed-Redis group, with the next
        item("service/checkpoints/test_code_storage.py", "c1"),
        item("integration/test_new.py", "n1"),  # not yet timed, marked: 8 s a test
    ]
    monkeypatch.setattr(conftest, "MARKS", {**MARKS, "integration/test_new.py": ("stack",)})
    times = {"service/test_a.py": 1.0, "integration/test_multinode.py": 300.0}
    times |= {"service/streams/test_logs.py": 20.0, "service/checkpoints/test_code_storage.py": 30.0}
    (tmp_path / "seconds.json").write_text(json.dumps(times))
    monkeypatch.setattr(conftest, "MODULE_SECONDS", tmp_path / "seconds.json")
    ordered = [i.name for i in conftest.longest_groups_first(items)]  # type: ignore[arg-type]
    assert ordered == ["m1", "m2", "s1", "c1", "n1", "a1", "a2"]
