"""`.ci/gpu` (#37) on a GPU host with no package index: what the suite needs besides torch is
named before anything runs, never a traceback from inside pytest's absence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_script_names_what_is_missing(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_smi = bin_dir / "nvidia-smi"
    fake_smi.write_text("#!/bin/sh\necho 'GPU 0: fake'\n")
    fake_smi.chmod(0o755)
    fake_python = bin_dir / "python-without"
    # an interpreter that finds none of the suite's packages (its own path holds only the stdlib)
    fake_python.write_text(f'#!/bin/sh\nexec {sys.executable} -S -I "$@"\n')
    fake_python.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(fake_python)}
    env.pop("WHEELS", None)
    done = subprocess.run(["bash", ".ci/gpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the GPU suite needs: pytest pytest-timeout numpy scikit-learn" in done.stderr
