"""Import boundaries, each checked in a fresh interpreter (an import made by another test in
this process would hide a leak): the launcher runs next to torchrun without the database
stack, and the client runs on a laptop without any of the server. And one read of the source:
the worker code calls the control plane only through the node seam (`service.nodes`)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATABASE_STACK = ("sqlalchemy", "alembic", "psycopg", "celery", "kombu")
SERVER_STACK = (*DATABASE_STACK, "fastapi", "starlette", "uvicorn", "sse_starlette", "redis")
# All of the server that code under workers/ may import: the node seam and the core modules.
WORKERS_MAY_IMPORT = (
    "service.nodes",
    "service.config",
    "service.db",
    "service.storage",
    "service.states",
    "service.errors",
    "service.models",
    "service.parent_death",
)


def loaded_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("code", "forbidden", "ours_allowed"),
    [
        pytest.param(
            "import workers.launcher.supervisor, workers.launcher.command, workers.launcher.sandbox\n"
            "import workers.launcher.agents, workers.launcher.sandbox_spares, workers.launcher.devices\n"
            "import workers.launcher.run_dir",
            DATABASE_STACK,
            ("workers.launcher", "service.states", "service.nodes.values", "service.parent_death"),
            id="launcher-without-the-database",
        ),
        pytest.param(
            "import service.client, service.client.commands, service.client.job_commands\n"
            "import service.client.code_commands, service.client.checkpoint_commands\n"
            "import service.client.admin_commands, service.client.webhook_commands\n"
            "import service.client.follow, service.client.spec, service.client.common\n"
            "import service.client.settings, service.client.errors, service.client.api\n"
            "import service.client.download, service.client.pack, service.client.folder_pack",
            SERVER_STACK,
            # a folder checkpoint's manifest and tar layout (contract §11): standard library only
            (
                "service.client",
                "service.states",
                "service.checkpoints.manifest",
                "service.checkpoints.tar_layout",
            ),
            id="client-without-the-server",
        ),
        pytest.param(
            "import service.cli.main",  # every client command starts here: the server's imports wait
            SERVER_STACK,
            (
                "service.cli",
                "service.client",
                "service.states",
                "service.checkpoints.manifest",
                "service.checkpoints.tar_layout",
            ),
            id="cli-entry-without-the-server",
        ),
    ],
)
def test_a_boundary_holds(code: str, forbidden: tuple[str, ...], ours_allowed: tuple[str, ...]) -> None:
    modules = loaded_after(code)
    assert [m for m in modules if m.split(".")[0] in forbidden] == []
    ours = [m for m in modules if m.split(".")[0] in ("service", "workers") and "." in m]
    strays = [
        m
        for m in ours
        if not m.startswith(ours_allowed)
        and m not in ("service.nodes", "workers.runtime", "service.checkpoints")
    ]
    assert strays == []


def test_the_server_and_the_workers_never_load_the_test_helpers() -> None:
    modules = loaded_after("import service.app, workers.agent, workers.node")
    assert [m for m in modules if m.startswith(("service.testing", "tests"))] == []


def test_the_probe_sees_a_leak() -> None:
    """The check itself can fail: the server's app does load the database stack."""
    modules = loaded_after("import service.jobs.lifecycle")
    assert "sqlalchemy" in modules


def service_imports_beyond(source: str, allowed: tuple[str, ...] = WORKERS_MAY_IMPORT) -> list[str]:
    """Each module of `service` the source imports (`import x` or `from x import y`, at any
    depth, in functions too) that is neither one of `allowed` nor inside one, as "line: module"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from service import nodes` imports the module service.nodes
            names = [f"service.{a.name}" if node.module == "service" else node.module for a in node.names]
        else:
            continue
        for name in names:
            inside = any(name == ok or name.startswith(f"{ok}.") for ok in allowed)
            if name.split(".")[0] == "service" and not inside:
                found.append(f"{node.lineno}: {name}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_workers_call_the_control_plane_only_through_the_node_seam() -> None:
    strays = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / "workers").rglob("*.py"))
        if (found := service_imports_beyond(path.read_text()))
    }
    assert strays == {}


def test_the_seam_check_sees_a_stray_import() -> None:
    planted = (
        "from service.nodes import claims, wire\n"
        "from service.config import Settings\n"
        "from service.jobs.lifecycle import claim_for_launch\n"
        "import service.hosts.states as host_states\n"
        "def run() -> None:\n"
        "    from service import nodes, scheduler\n"
        "    import service.nodesx\n"
    )
    assert service_imports_beyond(planted) == [
        "3: service.jobs.lifecycle",
        "4: service.hosts.states",
        "6: service.scheduler",
        "7: service.nodesx",
    ]
