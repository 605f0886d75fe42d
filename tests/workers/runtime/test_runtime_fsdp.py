"""The builtin trainer in `fsdp` mode (contract §11) on CPU processes (gloo) under torchrun:
DCP checkpoint folders written asynchronously, resumed on 1, 2 and 3 ranks, SIGTERM, and
resume sources of the wrong kind refused.

What was saved is read back in this process with DCP's own offline reader
(`dcp_to_torch_save`, no process group); what a run holds is what the trainer's debug dumps
(TORCHJOBS_DEBUG_DUMP_DIR) gather from every rank's shards with `get_state_dict(...,
full_state_dict=True)`: at each save (`full-NAME.pt`) and right after a resume (`full-resumed.pt`).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

STEPS_PER_EPOCH = {1: 16, 2: 8, 3: 5}  # 512 samples, 32 per rank and batch


def _folder_state(folder: Path, tmp: Path) -> dict[str, Any]:
    """A DCP folder's tensors, unsharded, read offline by DCP itself (its `.metadata` is a
    pickle: this test trusts the folder its own trainer wrote)."""
    out = tmp / f"{folder.parent.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def _trainer_state(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "torchjobs.pt", weights_only=True)


def _assert_same(a: Any, b: Any, where: str = "", *, atol: float = 0.0) -> None:
    """Nested dicts and lists of tensors and numbers, equal (or within `atol`)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}", atol=atol)
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]", atol=atol)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        torch.testing.assert_close(a, b, rtol=0.0, atol=atol, msg=f"{where} differs")
    else:
        assert a == b, where


def _dump(run: Any, name: str) -> dict[str, Any]:
    return torch.load(run.dir / "dump" / f"full-{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def fsdp(jobs: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 epochs on 2 ranks; then, at once: its epoch-2 folder resumed for a third epoch on 1 and
    on 3 ranks, and its epoch-1 folder resumed on 2 ranks up to epoch 2 again."""
    root = tmp_path_factory.mktemp("fsdp")

    def start(name: str, epochs: int, nproc: int, resume: Path | None = None, **hyper: Any) -> Any:
        config = jobs.config("fsdp", epochs=epochs, **hyper)
        config["gpus_per_node"] = nproc
        dump = str(root / name / "dump")
        return jobs.start(root / name, config, nproc=nproc, resume=resume, TORCHJOBS_DEBUG_DUMP_DIR=dump)

    two = start("two", 2, 2).ok()
    resumed = {
        1: start("one", 3, 1, two.checkpoints / "epoch-0002"),
        # 488 samples: still 5 steps per epoch on 3 ranks, and 97 validation samples, so rank 0
        # validates 2 batches of 32 and ranks 1 and 2 one: they run a padding forward (an FSDP
        # forward is a collective), else the job would hang here
        3: start("three", 3, 3, two.checkpoints / "epoch-0002", synthetic_size=488),
        2: start("again", 2, 2, two.checkpoints / "epoch-0001"),
    }
    for run in resumed.values():
        run.ok()
    return {"two": two, "resumed": resumed, "root": root}


def test_two_ranks_write_dcp_folders_in_order(fsdp: dict[str, Any]) -> None:
    run = fsdp["two"]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["epoch-0001", "epoch-0002"]
    for epoch, name in ((1, "epoch-0001"), (2, "epoch-0002")):
        folder = run.checkpoints / name
        assert sorted(p.name for p in folder.iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "torchjobs.pt",
        ]
        state = _trainer_state(folder)
        assert (state["epoch"], state["step"]) == (epoch, epoch * STEPS_PER_EPOCH[2])
        assert (state["meta"]["mode"], state["meta"]["world_size"]) == ("fsdp", 2)
        assert len(state["meta"]["rng"]["ranks"]) == 2
    # announced by rank 0 alone, before each folder appeared; written in the background
    announced = run.checkpoint_events()
    assert [(e["file"], e["epoch"], e["step"]) for e in announced] == [
        (f"epoch-{n:04d}", n, n * STEPS_PER_EPOCH[2]) for n in (1, 2)
    ]
    assert re.findall(
        r"\[torchjobs rank (\d)\] checkpoint \S+ \(staged; writing in the background; training held",
        run.output,
    ) == [
        "0",
        "0",
    ]
    assert [e["epoch"] for e in run.events() if "val_accuracy" in e] == [1, 2]


def test_an_async_save_holds_the_state_of_its_step(fsdp: dict[str, Any], tmp_path: Path) -> None:
    """Training went on while epoch-0001 was written: the folder still holds the model and
    optimizer as they were when the save was called (gathered then, from the live shards), and
    the last folder, waited for before the exit, is complete."""
    run = fsdp["two"]
    first = _folder_state(run.checkpoints / "epoch-0001", tmp_path)
    last = _folder_state(run.checkpoints / "epoch-0002", tmp_path)
    _assert_same(first, _dump(run, "epoch-0001"), "epoch-0001")
    _assert_same(last, _dump(run, "epoch-0002"), "epoch-0002")
    assert not torch.equal(first["model"]["0.weight"], last["model"]["0.weight"])
    assert any(k.endswith("running_var") for k in last["model"])  # BatchNorm buffers travel too
    assert not any(k.startswith(("module.", "_fsdp")) for k in last["model"])


@pytest.mark.parametrize("nproc", [1, 3])
def test_resumed_on_another_world_size_loads_the_saved_tensors(
    fsdp: dict[str, Any], nproc: int, tmp_path: Path
) -> None:
    run = fsdp["resumed"][nproc]
    saved = _folder_state(fsdp["two"].checkpoints / "epoch-0002", tmp_path)
    _assert_same(saved, _dump(run, "resumed"), f"resumed on {nproc}")
    assert f"resuming at epoch 2 (+0 batches), step {2 * STEPS_PER_EPOCH[nproc]}" in run.output
    assert "no RNG state for this world size" in run.output  # 2 ranks saved it: a warning only
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["epoch-0003"]
    folder = run.checkpoints / "epoch-0003"
    assert sorted(p.name for p in folder.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(nproc)]
    state = _trainer_state(folder)
    assert (state["epoch"], state["step"], state["meta"]["world_size"]) == (
        3,
        3 * STEPS_PER_EPOCH[nproc],
        nproc,
    )
    assert [e["epoch"] for e in run.events() if "val_accuracy" in e] == [3]


def test_resumed_on_the_same_world_size_ends_where_the_straight_run_ended(
    fsdp: dict[str, Any], tmp_path: Path
) -> None:
    """Epoch 1 resumed on 2 ranks: same data order (seed and epoch), same RNG, same shards; the
    second epoch ends on the weights and optimizer state the uninterrupted run saved."""
    again = _folder_state(fsdp["resumed"][2].checkpoints / "epoch-0002", tmp_path)
    straight = _folder_state(fsdp["two"].checkpoints / "epoch-0002", tmp_path)
    _assert_same(again, straight, "epoch-0002", atol=1e-6)


LONG = {"epochs": 2, "batch_size": 16, "synthetic_size": 1024, "report_every": 1}


def test_sigterm_saves_a_complete_folder_at_one_step_and_exits_75(jobs: Any, tmp_path: Path) -> None:
    config = jobs.config("fsdp", **LONG)
    config["gpus_per_node"] = 2
    victim = jobs.start(tmp_path / "victim", config, nproc=2)
    victim.wait_for_event(lambda e: e["step"] >= 3)
    os.killpg(victim.proc.pid, signal.SIGTERM)
    victim.wait(timeout=90)
    assert victim.returncode != 0
    stops = re.findall(r"\[torchjobs rank (\d)\] SIGTERM: stopped after step (\d+)", victim.output)
    assert sorted(r for r, _ in stops) == ["0", "1"], victim.output[-4000:]
    assert len({s for _, s in stops}) == 1
    step = int(stops[0][1])
    exits = re.findall(r"\[torchjobs rank (\d)\] preempted: exiting with 75", victim.output)
    assert sorted(exits) == ["0", "1"]
    folders = sorted(p for p in victim.checkpoints.iterdir() if p.is_dir())
    assert folders and (folders[-1] / ".metadata").is_file()
    assert _trainer_state(folders[-1])["step"] == step
    config["hyperparameters"]["epochs"] = 1 if step < 32 else 2
    resumed = jobs.start(tmp_path / "resumed", config, nproc=2, resume=folders[-1]).ok()
    assert re.search(rf"\] resuming at epoch \d \(\+\d+ batches\), step {step}\n", resumed.output)


def test_a_resume_source_of_the_other_kind_is_refused_by_name(
    jobs: Any, fsdp: dict[str, Any], tmp_path: Path
) -> None:
    file = tmp_path / "weights.pt"
    torch.save({"0.weight": torch.zeros(1)}, file)
    into_fsdp = jobs.start(tmp_path / "fsdp", jobs.config("fsdp", epochs=1), resume=file)
    folder = fsdp["two"].checkpoints / "epoch-0001"
    into_ddp = jobs.start(tmp_path / "ddp", jobs.config("ddp", epochs=1), resume=folder)
    into_fsdp.wait(), into_ddp.wait()
    assert into_fsdp.returncode != 0 and into_ddp.returncode != 0
    assert "checkpoint weights.pt is a file (single, dp or ddp); mode fsdp resumes only from a DCP" in (
        into_fsdp.output
    )
    assert "checkpoint epoch-0001 is a folder (a DCP checkpoint" in into_ddp.output


# ------------------------------------------------------------------------------------------ units


BASE_FSDP: dict[str, Any] = {
    "mode": "fsdp",
    "gpus_per_node": 2,
    "entrypoint": {"kind": "builtin", "model": "cnn", "dataset": "synthetic"},
}


def test_the_sharded_blocks_are_children_with_parameters_and_list_members() -> None:
    from torch import nn

    from workers.runtime.trainer.fsdp import shard_units

    head, first, second = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    model = nn.Sequential(head, nn.ReLU(), nn.ModuleList([first, nn.Identity(), second]))
    assert shard_units(model) == [head, first, second]


def test_fsdp_plans_one_process_per_gpu_like_ddp() -> None:
    from workers.launcher.command import processes_per_node
    from workers.runtime.env import RuntimeEnv
    from workers.runtime.trainer.config import parse_config
    from workers.runtime.trainer.plan import make_plan

    config = parse_config({**BASE_FSDP, "accelerator": "cpu"})
    env = RuntimeEnv(
        rank=3, local_rank=1, world_size=4, local_world_size=2, master_addr="10.0.0.1", master_port=29500
    )
    plan = make_plan(config, env, cuda_device_count=0)
    assert (plan.mode, plan.backend, plan.device, plan.rank, plan.world_size) == ("fsdp", "gloo", "cpu", 3, 4)
    cuda = make_plan(parse_config({**BASE_FSDP, "accelerator": "cuda"}), env, cuda_device_count=2)
    assert (cuda.backend, cuda.device) == ("nccl", "cuda:1")
    assert processes_per_node("fsdp", 4) == 4 and processes_per_node("ddp", 4) == 4
