"""The CPU twin of the GPU suite's harness (tests/workers/launcher/worker_node.py): a node run
as a worker runs it, in the worker's sandbox, under the real supervisor. What the GPU suite
relies on (issue #37) is shown here on the CPU: a builtin node preempted by SIGTERM saves a
checkpoint that a node of another world size resumes from; a script node runs as the sandbox
user; the two nodes of one job, each its own worker's, train together."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.states import NodeState
from tests.workers.launcher.worker_node import NodeSpec, assert_succeeded, run_node, run_nodes, script
from tests.workers.runtime.conftest import free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the worker's sandbox as a root worker builds it")

HYPER = {"epochs": 2, "batch_size": 32, "num_workers": 0, "synthetic_size": 512, "report_every": 2}


def test_a_node_preempted_in_its_sandbox_resumes_at_another_world_size(tmp_path: Path) -> None:
    long = {**HYPER, "epochs": 50, "checkpoint_every": 10_000}  # checkpoints only when stopped
    ddp = NodeSpec(mode="ddp", slots=(0, 1), hyperparameters=long, stop_grace_s=30)
    stopped = run_node(tmp_path / "a", ddp, stop_when=lambda r: bool(r.progress()))
    assert stopped.outcome is not None and stopped.outcome.state == NodeState.LOST, stopped.output[-3000:]
    assert stopped.outcome.error == "preempted"
    assert stopped.checkpoints, stopped.output[-3000:]  # rank 0 saved at SIGTERM, within the grace
    name, blob = list(stopped.checkpoints.items())[-1]
    resume = tmp_path / name
    resume.write_bytes(blob)
    single = NodeSpec(slots=(0,), hyperparameters={**long, "epochs": 1}, resume=resume)
    resumed = run_node(tmp_path / "b", single)
    assert_succeeded(resumed)
    assert "resuming at epoch" in resumed.output, resumed.output[-3000:]


def test_a_script_node_runs_as_the_sandbox_user(tmp_path: Path) -> None:
    text = "import os\nprint('uid', os.getuid(), 'cwd', os.getcwd(), flush=True)\n"
    probe = script(tmp_path, "whoami.py", text)
    spec = NodeSpec(entrypoint={"kind": "script", "path": "whoami.py"}, script_path=probe)
    record = run_node(tmp_path, spec)
    assert_succeeded(record)
    (line,) = [x for x in record.output.splitlines() if x.startswith("uid ")]
    assert line.split()[1] != "0" and line.endswith("cwd /job"), line


def test_the_two_nodes_of_a_job_each_in_its_own_workers_sandbox_train_together(tmp_path: Path) -> None:
    port = free_port()
    specs = [
        NodeSpec(mode="ddp", nnodes=2, node_rank=rank, master_port=port, hyperparameters=HYPER)
        for rank in (0, 1)
    ]
    node0, node1 = run_nodes(tmp_path, specs)
    assert_succeeded(node0)
    assert_succeeded(node1)
    assert node0.checkpoints and not node1.checkpoints  # rank 0 writes the file checkpoints
    meta = node0.last_checkpoint()["meta"]
    assert meta["world_size"] == 2, meta
    assert "placement: cpu, backend gloo" in node1.output, node1.output[-3000:]


def test_an_fsdp_node_saves_its_dcp_folder_from_the_sandbox_and_one_rank_resumes_it(tmp_path: Path) -> None:
    spec = NodeSpec(mode="fsdp", slots=(0, 1), hyperparameters=HYPER)
    record = run_node(tmp_path / "a", spec)
    assert_succeeded(record)
    files = record.folders["epoch-0002"]
    assert ".metadata" in files and {"__0_0.distcp", "__1_0.distcp"} <= set(files), sorted(files)
    folder = record.written(tmp_path / "ckpts") / "epoch-0002"
    one = NodeSpec(mode="fsdp", slots=(0,), hyperparameters={**HYPER, "epochs": 3}, resume=folder)
    resumed = run_node(tmp_path / "b", one)
    assert_succeeded(resumed)
    assert "resuming at epoch 2" in resumed.output, resumed.output[-3000:]
    assert ".metadata" in resumed.folders["epoch-0003"]
