"""Every `state` column is written by its gate only (`service.jobs.states` for jobs and node
runs, `service.hosts.states` for worker hosts): an AST scan of the whole tree, in the spirit
of Polar's own linters. Tests and benchmarks seed through the gates too (tests/factories.py).

Flagged: `x.state = ...` (also in tuple targets and augmented), `setattr(x, "state", ...)`,
`.values(state=...)` and `Job(state=...)`/`NodeRun(state=...)`/`Worker(state=...)`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from service.states import (
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    SWEEP_TRANSITIONS,
    WORKER_TRANSITIONS,
    JobState,
    NodeState,
    WorkerState,
    job_may_move,
    node_may_move,
    worker_may_move,
)

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("service", "workers", "bench", "tests")
GATES = {Path("service/jobs/states.py"), Path("service/hosts/states.py")}
MODELS_WITH_STATE = {"Job", "NodeRun", "Worker"}


def state_writes(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_writes_state(t) for t in targets):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and (_setattr_state(node) or _state_keyword(node)):
            lines.append(node.lineno)
    return sorted(lines)


def _writes_state(target: ast.AST) -> bool:
    if isinstance(target, ast.Tuple | ast.List):
        return any(_writes_state(t) for t in target.elts)
    return isinstance(target, ast.Attribute) and target.attr == "state"


def _setattr_state(call: ast.Call) -> bool:
    return (
        isinstance(call.func, ast.Name)
        and call.func.id == "setattr"
        and len(call.args) >= 2
        and isinstance(call.args[1], ast.Constant)
        and call.args[1].value == "state"
    )


def _state_keyword(call: ast.Call) -> bool:
    if not any(k.arg == "state" for k in call.keywords):
        return False
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr == "values") or (
        isinstance(func, ast.Name) and func.id in MODELS_WITH_STATE
    )


def test_no_module_outside_the_gates_writes_a_state_column() -> None:
    found = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO)
            if rel in GATES:
                continue
            found += [f"{rel}:{line}" for line in state_writes(ast.parse(path.read_text(), str(rel)))]
    assert found == []


def test_the_scan_finds_each_kind_of_write() -> None:
    source = """
job.state = "running"
run.state, run.finished_at = "lost", now
setattr(worker, "state", "offline")
session.execute(update(Job).values(state="failed"))
Worker(name="w", state="online")
app.state.db = db          # not a state column
NodeOutcome(state="failed")  # a value, not a row
"""
    assert sorted(state_writes(ast.parse(source))) == [2, 3, 4, 5, 6]


def test_the_gates_exist_where_the_scan_exempts_them() -> None:
    for gate in GATES:
        assert state_writes(ast.parse((REPO / gate).read_text())), f"{gate} writes no state: stale exemption"


def test_job_transitions() -> None:
    assert set(JOB_TRANSITIONS) == set(JobState)
    allowed = {(a, b) for a, targets in JOB_TRANSITIONS.items() for b in targets}
    assert allowed == {
        ("queued", "scheduled"),
        ("queued", "cancelling"),
        ("queued", "cancelled"),
        ("queued", "failed"),
        ("scheduled", "running"),
        ("scheduled", "queued"),
        ("scheduled", "failed"),
        ("scheduled", "succeeded"),
        ("scheduled", "cancelling"),
        ("running", "succeeded"),
        ("running", "failed"),
        ("running", "queued"),
        ("running", "cancelling"),
        ("cancelling", "cancelled"),
    }
    for end in ("succeeded", "failed", "cancelled"):
        assert not any(job_may_move(end, s) for s in JobState)
    assert not job_may_move("queued", "running")  # never without a placement
    assert not job_may_move("queued", "bogus") and not job_may_move("bogus", "queued")


def test_node_run_transitions() -> None:
    assert set(NODE_TRANSITIONS) == set(NodeState)
    assert node_may_move("pending", "running") and node_may_move("running", "succeeded")
    assert not node_may_move("pending", "succeeded")  # a node that never ran did not succeed
    assert not node_may_move("pending", "failed")  # nor fail: its worker claims it first
    for end in ("succeeded", "failed", "cancelled", "lost"):
        assert node_may_move("running", end)
        assert not any(node_may_move(end, s) for s in NodeState)  # the first end wins
    assert not node_may_move("running", "pending")


def test_worker_transitions() -> None:
    assert set(WORKER_TRANSITIONS) == set(WorkerState)
    allowed = {(a, b) for a, targets in WORKER_TRANSITIONS.items() for b in targets}
    assert allowed == {("online", "offline"), ("offline", "online"), ("online", "online")}
    assert not worker_may_move("offline", "offline") and not worker_may_move("online", "draining")


def test_sweep_transitions() -> None:
    """A sweep's parent (contract §10): running from its creation, ended by its children."""
    assert set(SWEEP_TRANSITIONS) == set(JobState)
    allowed = {(a, b) for a, targets in SWEEP_TRANSITIONS.items() for b in targets}
    assert allowed == {
        ("queued", "running"),
        ("running", "succeeded"),
        ("running", "failed"),
        ("running", "cancelling"),
        ("cancelling", "cancelled"),
    }
    assert job_may_move("queued", "running", "sweep") and not job_may_move("queued", "running")
    assert not job_may_move("queued", "scheduled", "sweep")  # a parent is never placed
