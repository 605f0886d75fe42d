"""Import boundaries, each checked in a fresh interpreter (an import made by another test in
this process would hide a leak): the launcher runs next to torchrun without the database
stack, and the client runs on a laptop without any of the server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATABASE_STACK = ("sqlalchemy", "alembic", "psycopg", "celery", "kombu")
SERVER_STACK = (*DATABASE_STACK, "fastapi", "starlette", "uvicorn", "sse_starlette", "redis")


def loaded_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("code", "forbidden", "ours_allowed"),
    [
        pytest.param(
            "import workers.launcher.supervisor, workers.launcher.command, workers.launcher.sandbox\n"
            "import workers.launcher.warm_pool, workers.launcher.sandbox_spares, workers.launcher.devices",
            DATABASE_STACK,
            ("workers.launcher", "service.states", "service.jobs.node_reports", "service.parent_death"),
            id="launcher-without-the-database",
        ),
        pytest.param(
            "import service.client, service.client.commands, service.client.download\n"
            "import service.client.admin_commands, service.client.webhook_commands",
            SERVER_STACK,
            ("service.client", "service.states", "service.config"),
            id="client-without-the-server",
        ),
    ],
)
def test_a_boundary_holds(code: str, forbidden: tuple[str, ...], ours_allowed: tuple[str, ...]) -> None:
    modules = loaded_after(code)
    assert [m for m in modules if m.split(".")[0] in forbidden] == []
    ours = [m for m in modules if m.split(".")[0] in ("service", "workers") and "." in m]
    strays = [
        m for m in ours if not m.startswith(ours_allowed) and m not in ("service.jobs", "workers.runtime")
    ]
    assert strays == []


def test_the_server_and_the_workers_never_load_the_test_helpers() -> None:
    modules = loaded_after("import service.app, workers.agent, workers.node")
    assert [m for m in modules if m.startswith(("service.testing", "tests"))] == []


def test_the_probe_sees_a_leak() -> None:
    """The check itself can fail: the server's app does load the database stack."""
    modules = loaded_after("import service.jobs.lifecycle")
    assert "sqlalchemy" in modules
