"""`.ci/setup` leaves the environment and our packages compiled: a module without its .pyc is
compiled from source by every process that imports it wherever nothing may write the .pyc
(PYTHONDONTWRITEBYTECODE, a rank's read-only view of the environment), which cost each rank,
server, worker and CLI call seconds of CPU. Checked on modules every such process imports."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what a rank (numpy, through torch), a server or worker (the web and database stack, Celery)
# and every process of ours import; none is installed by pip, which compiles on its own
EVERY_PROCESS_IMPORTS = (
    "numpy",
    "sqlalchemy.orm",
    "fastapi",
    "pydantic",
    "celery",
    "service.app",
    "workers.runtime",
)


@pytest.mark.parametrize("name", EVERY_PROCESS_IMPORTS)
def test_the_module_has_bytecode(name: str) -> None:
    module = importlib.import_module(name)
    source = Path(module.__file__ or "")
    cached = Path(importlib.util.cache_from_source(str(source)))
    assert cached.is_file(), f"{name}: no {cached} (run bash .ci/setup)"
    assert cached.stat().st_size > 0


def test_a_fresh_interpreter_compiles_nothing_of_ours() -> None:
    """With writing forbidden, as on this machine and in a rank, an import of the server's
    package reads bytecode only: every module it loads from our packages has its .pyc."""
    probe = (
        "import sys, importlib.util, os, service.app, workers.runtime\n"
        "missing = [m.__name__ for m in list(sys.modules.values())\n"
        "           if getattr(m, '__file__', None) and m.__file__.endswith('.py')\n"
        "           and m.__name__.split('.')[0] in ('service', 'workers')\n"
        "           and not os.path.exists(importlib.util.cache_from_source(m.__file__))]\n"
        "print(missing)"
    )
    out = subprocess.run(
        [sys.executable, "-B", "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
