"""The runtime stands alone: a rank that imports it loads no web stack and nothing else of ours."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

FORBIDDEN = (
    "fastapi",
    "starlette",
    "sqlalchemy",
    "alembic",
    "celery",
    "kombu",
    "redis",
    "pydantic",
    "pydantic_settings",
    "uvicorn",
    "httpx",
    "service",
)

PROBE = """
import json, sys
import workers.runtime
light = "torch" in sys.modules
import workers.runtime.trainer.train, workers.runtime.checkpoint
print(json.dumps({"modules": sorted(sys.modules), "torch_after_package_import": light}))
"""


def test_importing_the_runtime_loads_no_web_stack_and_nothing_else_of_ours(jobs: Any) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=jobs.child_env(),
        capture_output=True,
        text=True,
        check=True,
        cwd=jobs.repo,
    )
    probe = json.loads(out.stdout)
    modules = probe["modules"]
    loaded = [m for m in modules if m.split(".")[0] in FORBIDDEN]
    assert loaded == []
    ours = [m for m in modules if m.startswith("workers.") and not m.startswith("workers.runtime")]
    assert ours == []
    assert "torch" in modules and not probe["torch_after_package_import"]  # report() is cheap to import


def test_workers_package_init_is_empty(jobs: Any) -> None:
    assert (jobs.repo / "workers" / "__init__.py").read_text() == ""
