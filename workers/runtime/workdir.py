"""Entering the job's own code (contract §6): its private copy becomes the working directory
and the first place imports look.

A job's code may hold top-level packages named like torchjobs' own (`workers`, `service`).
`service` is never imported in a rank, so the job's own simply wins. `workers` is: this very
library lives in it, and a script calls `workers.runtime.report`. So the two are merged rather
than one hiding the other: torchjobs' package (whose `__init__.py` is empty on purpose) gains
the job's `workers/` folder on its `__path__`, and the job's `__init__.py` runs in it. Then
`workers.runtime` is ours and `workers.anything_else` is the job's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

WORKDIR_ENV = "TORCHJOBS_WORKDIR"
SHARED_PACKAGES = ("workers",)


def enter_workdir(environ: dict[str, str] | None = None) -> Path | None:
    """chdir into the job's copy of its code; None (and no change) for a job without code."""
    raw = (environ if environ is not None else os.environ).get(WORKDIR_ENV)
    if not raw:
        return None
    workdir = Path(raw)
    os.chdir(workdir)
    return workdir


def import_first(root: Path) -> None:
    """`root` first on sys.path, and its packages named like ours merged into ours."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for name in SHARED_PACKAGES:
        merge_package(name, root / name)


def merge_package(name: str, folder: Path) -> None:
    """Let an already imported package of ours also find the submodules in `folder`."""
    package = sys.modules.get(name)
    if package is None or not folder.is_dir() or not hasattr(package, "__path__"):
        return
    if str(folder) not in package.__path__:
        package.__path__.append(str(folder))
    init = folder / "__init__.py"
    if init.is_file():
        code = compile(init.read_bytes(), str(init), "exec")
        exec(code, package.__dict__)  # the job's own package initialiser, in its own process
