"""The pre-flight under real torchrun on one host: ranks meet before user code, the private
group is gone when a script starts, and a rank that cannot connect fails naming itself.
Across two hosts with a black-holed route: tests/integration/test_multinode.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from service.testing.harness import free_port

SCRIPTS = Path(__file__).parent / "scripts"


def _torchrun(jobs: Any, cwd: Path, nproc: int, *target: str, **env: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        *target,
    ]
    return subprocess.run(
        argv, cwd=cwd, env=jobs.child_env(**env), capture_output=True, text=True, timeout=180, check=False
    )


def _probes(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]


def test_a_script_starts_as_if_python_ran_it_after_the_preflight(jobs: Any, tmp_path: Path) -> None:
    probe = str(SCRIPTS / "probe.py")
    done = _torchrun(
        jobs, tmp_path, 2, "-m", "workers.runtime.script", probe, "--lr", "0.1", PROBE_DIR=str(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = _probes(tmp_path)
    assert sorted(p["rank"] for p in seen) == ["0", "1"]
    for p in seen:
        assert p["name"] == "__main__" and p["file"] == probe
        assert p["argv"] == [probe, "--lr", "0.1"] and p["path0"] == str(SCRIPTS)
        # the pre-flight's group is private and already gone: the script inits its own
        assert p["default_group"] is False


def test_the_builtin_trainer_reports_the_preflight(jobs: Any, tmp_path: Path) -> None:
    run = jobs.start(tmp_path / "run", jobs.config("ddp", epochs=1), nproc=2).ok()
    assert "pre-flight: all 2 ranks reached each other in" in run.output


def test_a_rank_that_cannot_open_its_sockets_fails_naming_itself(jobs: Any, tmp_path: Path) -> None:
    probe = str(SCRIPTS / "probe.py")
    done = _torchrun(
        jobs,
        tmp_path,
        2,
        "-m",
        "workers.runtime.script",
        probe,
        GLOO_SOCKET_IFNAME="tjnone0",
        PROBE_DIR=str(tmp_path),
    )
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "PreflightError" in out and "pre-flight could not connect to every other rank" in out, out[-3000:]
    assert "rank 0 of 2 (node 0, host" in out or "rank 1 of 2 (node 0, host" in out
    assert _probes(tmp_path) == []  # the script itself never ran


def test_the_gpu_check_is_skipped_without_cuda_and_knows_a_wrong_product() -> None:
    """The CUDA half (an allocation, a matmul, a read-back on each of the rank's GPUs) needs a
    GPU and is in tests/gpu/; here: it does nothing on CPU, and its comparison catches a GPU
    that computes garbage."""
    import pytest
    import torch

    from workers.runtime.env import RuntimeEnv
    from workers.runtime.preflight import check_gpus, check_product, known_factor

    check_gpus(RuntimeEnv(accelerator="cpu", world_size=1))
    right = known_factor() @ known_factor()
    check_product(right, 0)
    wrong = right.clone()
    wrong[3, 7] += 1.0
    with pytest.raises(RuntimeError, match="GPU 2 computed a wrong matrix product"):
        check_product(wrong, 2)
    assert torch.isfinite(right).all()


def test_the_gpu_check_runs_in_a_child_and_reports_how_it_ended() -> None:
    """The rank's own process never touches CUDA for the check (gpu_check.py says why); the
    child's answer is read as data: a named GPU, or how it died."""
    import subprocess
    import sys

    import torch

    from workers.runtime.env import RuntimeEnv
    from workers.runtime.preflight import _gpu_failure, check_gpus

    check_gpus(RuntimeEnv(accelerator="cuda", local_world_size=1))  # no CUDA here: the child says so
    assert not torch.cuda.is_initialized()
    ran = subprocess.run(
        [sys.executable, "-m", "workers.runtime.gpu_check", "all"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0 and ran.stdout == ""
    misused = subprocess.run(
        [sys.executable, "-m", "workers.runtime.gpu_check", "x"], capture_output=True, text=True, check=False
    )
    assert (
        _gpu_failure(misused)
        == "its GPUs: the check exited with 2: usage: python -m workers.runtime.gpu_check all|INDEX"
    )
    named = subprocess.CompletedProcess(
        [], 1, stdout="GPU 3: CUDA error: an illegal memory access\n", stderr=""
    )
    assert _gpu_failure(named).startswith("GPU 3: CUDA error: an illegal memory access (an index into")
