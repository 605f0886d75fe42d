"""SQL lives in the repositories (ARCHITECTURE.md, Rules): an AST scan of `service/`, as
`tests/test_state_gates.py` scans for state writes, so that the rule stays true rather than
being true once.

Flagged: a call `X.execute(`, `X.scalar(`, `X.scalars(`, `X.get(` or `X.add(` where X is a name
or an attribute called `session` or `db` (`session.execute(...)`, `self.session.get(...)`),
in any module but a `repository.py` and the three writers that keep their statements next to
the row lock or the gate they serve (`WRITERS`).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUERY_CALLS = frozenset({"execute", "scalar", "scalars", "get", "add"})
HOLDERS = frozenset({"session", "db"})
# Their SQL is the lock itself: moving it away from the code it guards would hide the lock.
WRITERS = frozenset(
    {
        Path("service/jobs/states.py"),  # the job gate: lock_job(), the event `seq` UPDATE
        Path("service/hosts/states.py"),  # the host gate: Worker.state, upsert_worker()'s lock
        Path("service/scheduler/placement_pass.py"),  # advisory lock, FOR UPDATE SKIP LOCKED
    }
)


def query_calls(tree: ast.AST) -> list[int]:
    """The lines of the SQL calls on a session (or a `db`) in a parsed module."""
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in QUERY_CALLS
        and _holder(node.func.value) in HOLDERS
    )


def _holder(value: ast.expr) -> str | None:
    """`session` in `session.execute`, and in `self.session.execute`; None for anything else."""
    if isinstance(value, ast.Name):
        return value.id
    if isinstance(value, ast.Attribute):
        return value.attr
    return None


def _exempt(rel: Path) -> bool:
    return rel.name == "repository.py" or rel in WRITERS


def test_sql_is_only_in_repositories_and_the_locking_writers() -> None:
    found = []
    for path in sorted((REPO / "service").rglob("*.py")):
        rel = path.relative_to(REPO)
        if _exempt(rel):
            continue
        found += [f"{rel}:{line}" for line in query_calls(ast.parse(path.read_text(), str(rel)))]
    assert found == [], "SQL outside a repository.py (move it there):\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_call() -> None:
    source = """
session.execute(select(Job))
rows = session.scalars(select(Job)).all()
n = session.scalar(select(func.count()))
job = self.session.get(Job, 1)
db.add(row)
settings.get("x")          # not a session
session.flush()            # not a query call of the rule
conn.execute(select(Job))  # a connection: not a session
"""
    assert query_calls(ast.parse(source)) == [2, 3, 4, 5, 6]


def test_a_planted_query_in_a_service_module_is_flagged() -> None:
    source = "def f(session):\n    return session.execute(select(Job)).all()\n"
    assert query_calls(ast.parse(source)) == [2]
    assert not _exempt(Path("service/jobs/service.py"))
    assert _exempt(Path("service/jobs/repository.py"))


def test_the_writers_exist_and_still_hold_sql() -> None:
    for writer in WRITERS:
        assert query_calls(ast.parse((REPO / writer).read_text())), f"{writer} has no SQL: stale exemption"
