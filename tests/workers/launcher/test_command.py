"""The pure launch planner: argv, environment and folders for every mode and entrypoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.launcher.command import NodeLaunch, build_launch, processes_per_node

BUILTIN = {"kind": "builtin", "model": "cnn", "dataset": "digits"}


def launch(**overrides: object) -> NodeLaunch:
    fields: dict[str, object] = dict(
        job_id=7,
        attempt=2,
        node_rank=0,
        nnodes=1,
        mode="ddp",
        gpus=(0, 1),
        accelerator="cpu",
        master_addr="127.0.0.1",
        master_port=29555,
        entrypoint=BUILTIN,
        hyperparameters={"epochs": 2},
        script_path=None,
        run_dir=Path("/runs/j7"),
        python="/py",
        base_env={
            "PATH": "/bin",
            "TORCHJOBS_DATABASE_URL": "postgresql://secret",
            "MASTER_PORT": "1",
            "RANK": "9",
        },
        user_env={"MY_FLAG": "1"},
    )
    fields.update(overrides)
    return NodeLaunch(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "gpus", "nproc"), [("single", 1, 1), ("dp", 4, 1), ("ddp", 4, 4), ("ddp", 1, 1)]
)
def test_processes_per_node(mode: str, gpus: int, nproc: int) -> None:
    assert processes_per_node(mode, gpus) == nproc


def test_builtin_ddp_argv() -> None:
    plan = build_launch(launch())
    assert plan.argv[:3] == ["/py", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in plan.argv and "--nnodes=1" in plan.argv and "--node-rank=0" in plan.argv
    assert "--master-addr=127.0.0.1" in plan.argv and "--master-port=29555" in plan.argv
    assert "--rdzv-id=torchjobs-7-2" in plan.argv and "--redirects=3" in plan.argv
    assert plan.argv[-4:] == ["-m", "workers.runtime.train", "--config", "/runs/j7/config.json"]
    assert plan.config == {
        "mode": "ddp",
        "accelerator": "cpu",
        "gpus_per_node": 2,
        "entrypoint": BUILTIN,
        "hyperparameters": {"epochs": 2},
    }


def test_script_argv_runs_the_file_with_its_args() -> None:
    plan = build_launch(
        launch(
            entrypoint={"kind": "script", "path": "t.py", "args": ["--lr", "0.1"]},
            script_path="/roots/t.py",
            mode="single",
            gpus=(1,),
        )
    )
    # the file itself runs unchanged, behind the pre-flight wrapper
    assert plan.argv[-5:] == ["-m", "workers.runtime.script", "/roots/t.py", "--lr", "0.1"]
    assert plan.config is None
    assert "--nproc-per-node=1" in plan.argv


def test_rank_environment_is_the_contract_and_nothing_of_ours() -> None:
    env = build_launch(launch(resume_path="/cache/abc.pt")).env
    assert env["TORCHJOBS_JOB_ID"] == "7"
    assert env["TORCHJOBS_CHECKPOINT_DIR"] == "/runs/j7/checkpoints"
    assert env["TORCHJOBS_EVENTS"] == "/runs/j7/events.jsonl"
    assert env["TORCHJOBS_RESUME_FROM"] == "/cache/abc.pt"
    assert env["MY_FLAG"] == "1" and env["PATH"] == "/bin"
    assert "TORCHJOBS_DATABASE_URL" not in env  # the worker's secrets never reach a rank
    assert "MASTER_PORT" not in env and "RANK" not in env  # torchrun sets these itself
    assert env["TMPDIR"].startswith("/tmp/torchjobs-")
    assert env["TORCHJOBS_PREFLIGHT_TIMEOUT_S"] == "60"


def test_tmpdir_stays_short_for_unix_sockets_however_deep_the_home() -> None:
    deep = Path("/" + "/".join(["very-long-folder-name"] * 12))
    env = build_launch(launch(run_dir=deep)).env
    # torch's multiprocessing puts sockets like TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX there
    assert len(env["TMPDIR"]) + len("/pymp-abcdefgh/listener-abcdefgh") < 100
    assert build_launch(launch(run_dir=deep / "other")).env["TMPDIR"] != env["TMPDIR"]


def test_cuda_hosts_pin_the_assigned_devices() -> None:
    env = build_launch(launch(accelerator="cuda", gpus=(2, 3))).env
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    cpu_env = build_launch(launch(accelerator="cpu", gpus=(2, 3))).env
    assert cpu_env["CUDA_VISIBLE_DEVICES"] == "" and cpu_env["TORCHJOBS_SLOTS"] == "2,3"


def test_no_resume_means_no_variable() -> None:
    assert "TORCHJOBS_RESUME_FROM" not in build_launch(launch()).env


@pytest.mark.parametrize(
    "bad",
    [dict(mode="zz"), dict(node_rank=1), dict(gpus=()), dict(entrypoint={"kind": "script", "path": "x"})],
)
def test_inconsistent_launches_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        launch(**bad)


def test_multi_node_argv() -> None:
    plan = build_launch(launch(nnodes=2, node_rank=1, master_addr="10.0.0.2"))
    assert (
        "--nnodes=2" in plan.argv and "--node-rank=1" in plan.argv and "--master-addr=10.0.0.2" in plan.argv
    )
