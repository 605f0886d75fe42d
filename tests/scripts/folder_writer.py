"""Writes folder checkpoints as frameworks do (contract §11): tests/integration/test_folder_checkpoints.py.

FOLDER_CASE picks what each rank (every rank runs it) writes into TORCHJOBS_CHECKPOINT_DIR:

- ranks: every rank its own file into `step-1/`, rank 0 a shared file, then (once every rank's
  file is there) `trainer_state.json`, as HF Trainer does.
- slow: rank 0 writes `slow/a.bin`, pauses 4 s, writes `slow/b.bin` (no mark: settle time).
- keep: rank 0 writes `ckpt-1`, `ckpt-2`, `ckpt-3`, each marked with `checkpoint_done`.
- retry: attempt 1 writes `state/` (marked) and is then SIGKILLed (a lost worker, retried); a
  later attempt reports what it finds in its checkpoint folder and at TORCHJOBS_RESUME_FROM.
- nodes: (2 nodes) each rank its own shard into `dcp/`, both nodes `dcp/common.json`, rank 0
  DCP's `.metadata` last.
- sleep: nothing for 120 s (a job that others wait for).
"""

import json
import os
import signal
import time

from workers.runtime import checkpoint_done

case = os.environ["FOLDER_CASE"]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ckpts = os.environ["TORCHJOBS_CHECKPOINT_DIR"]
attempt = int(os.environ.get("TORCHJOBS_ATTEMPT", "1"))


def put(rel, data):
    path = os.path.join(ckpts, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)


def emit(event):
    with open(os.environ["TORCHJOBS_EVENTS"], "a") as fh:
        fh.write(json.dumps(event) + "\n")


def read_tree(root):
    found = {}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as fh:
                found[os.path.relpath(path, root)] = fh.read().decode()
    return found


if case == "ranks":
    put(f"step-1/rank-{rank}.bin", f"rank {rank}".encode() * 100)
    if rank == 0:
        put("step-1/model/weights.bin", b"w" * 5000)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(ckpts, f"step-1/rank-{r}.bin")) for r in range(world)
        ):
            time.sleep(0.1)
        put("step-1/trainer_state.json", json.dumps({"global_step": 1}).encode())
        emit({"type": "checkpoint", "file": "step-1", "epoch": 1, "step": 1})
    time.sleep(3)
elif case == "slow" and rank == 0:
    put("slow/a.bin", b"a" * 1000)
    time.sleep(4)
    put("slow/b.bin", b"b" * 1000)
elif case == "keep" and rank == 0:
    for i in (1, 2, 3):
        put(f"ckpt-{i}/weights.bin", str(i).encode() * 1000)
        checkpoint_done(f"ckpt-{i}")
        time.sleep(2.5)
elif case == "nodes":  # a DCP-style save from every rank of two nodes, plus a path both write
    node = int(os.environ.get("GROUP_RANK", "0"))
    put(f"dcp/__{rank}_0.distcp", f"shard {rank}".encode() * 50)
    put("dcp/common.json", f"node {node}".encode())
    if rank == 0:
        time.sleep(1.5)
        put("dcp/.metadata", b"metadata")
    time.sleep(4)
elif case == "sleep":
    time.sleep(120)
elif case == "retry" and rank == 0:
    if attempt == 1:
        put("state/weights.bin", b"v1" * 500)
        put("state/trainer_state.json", b"{}")
        time.sleep(4)  # taken by then
        os.kill(os.getpid(), signal.SIGKILL)
    resume = os.environ.get("TORCHJOBS_RESUME_FROM", "")
    emit(
        {
            "type": "progress",
            "step": attempt,
            "metrics": {"resume_is_folder": float(os.path.isdir(resume))},
        }
    )
    print("FOUND", json.dumps(read_tree(os.path.join(ckpts, "state"))), flush=True)
    print("RESUME", json.dumps(read_tree(resume) if os.path.isdir(resume) else {}), flush=True)
    time.sleep(2)
