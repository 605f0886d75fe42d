"""A user's own code, end to end (contract §6): a folder with a torchrun-style DDP script, a
local module, a `workers` package of its own and a factory module, packed and uploaded by
`torchjobs submit --workdir`, run by a real worker in a sandbox, in a private copy."""

from __future__ import annotations

import subprocess
from pathlib import Path

from service.testing import harness

TRAIN = """
import os
import torch
import torch.distributed as dist

import helper
import tabulate
import workers
from workers.extra import GREETING
from workers.runtime import report

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
loss = net(torch.randn(8, 4)).sum()
loss.backward()
print(f"rank {rank}: {GREETING}; {workers.FROM_INIT}; {helper.twice(21)}; cwd={os.getcwd()}", flush=True)
print(f"tabulate {tabulate.__version__} from {tabulate.__file__}", flush=True)
with open("scratch.txt", "w") as fh:  # the copy is the node's own, writable
    fh.write("mine")
if rank == 0:
    report(epoch=1, epochs=1, loss=float(loss))
    folder = os.environ["TORCHJOBS_CHECKPOINT_DIR"]
    torch.save({"state_dict": {"net": net.module.state_dict()}}, os.path.join(folder, "own.pt"))
dist.barrier()
dist.destroy_process_group()
"""

FACTORY = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g))
"""


def project(root: Path) -> Path:
    folder = root / "proj"
    (folder / "workers").mkdir(parents=True)
    (folder / "train.py").write_text(TRAIN)
    (folder / "helper.py").write_text("def twice(x):\n    return 2 * x\n")
    (folder / "workers" / "__init__.py").write_text("FROM_INIT = 'their __init__ ran'\n")
    (folder / "workers" / "extra.py").write_text("GREETING = 'their own workers package'\n")
    (folder / "mymodels.py").write_text(FACTORY)
    (folder / "secret.txt").write_text("left out\n")
    (folder / ".torchjobsignore").write_text("secret.txt\n")
    (folder / "job.yaml").write_text(
        "mode: ddp\ngpus_per_node: 2\nentrypoint:\n  kind: script\n  path: train.py\n  args: []\n"
        "environment:\n  pip: ['tabulate==0.10.0']\n"
    )
    return folder


def cli(stack: harness.Stack, token: str, *args: str) -> str:
    env = {**stack.env, "TORCHJOBS_URL": stack.url, "TORCHJOBS_TOKEN": token}
    done = subprocess.run(harness.torchjobs_cmd(*args), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_own_code_runs_in_its_own_copy(embedded: harness.Stack, tmp_path: Path) -> None:
    with embedded.client() as admin:
        token = admin.post("/v1/users", json={"name": "coder"}).json()["token"]
    folder = project(tmp_path)
    job_id = int(cli(embedded, token, "submit", str(folder / "job.yaml"), "--workdir", str(folder)))
    job = embedded.wait_job(job_id)
    assert job["state"] == "succeeded", embedded.describe(job_id)
    with embedded.client(token) as c:
        code = c.get(f"/v1/code/{job['code']}").json()
        log = c.get(f"/v1/jobs/{job_id}/logs", params={"rank": 1}).text
    assert code["files"] == 7 and code["owner"] == "coder"  # secret.txt left out by .torchjobsignore
    assert "their own workers package; their __init__ ran; 42" in log
    assert "cwd=/job/workdir" in log or f"cwd={embedded.home}" in log
    assert log.index("environment: building for tabulate==0.10.0") < log.index("their own workers package")
    assert "tabulate 0.10.0 from " in log and "/envs/" in log
    assert cli(embedded, token, "code", "push", str(folder)) == job["code"]  # already there: not sent
    with embedded.client(token) as c:
        assert [item["id"] for item in c.get("/v1/code").json()["items"]] == [job["code"]]
        factory = {"kind": "factory", "model": "mymodels:model", "dataset": "mymodels:data"}
        spec = {"mode": "ddp", "gpus_per_node": 2, "entrypoint": factory, "code": job["code"]}
        spec["environment"] = {"pip": ["tabulate==0.10.0"]}
        spec["hyperparameters"] = {"epochs": 1, "batch_size": 8, "num_workers": 0}
        second = c.post("/v1/jobs", json=spec).json()
    done = embedded.wait_job(second["id"])
    assert done["state"] == "succeeded", embedded.describe(second["id"])
    assert done["latest_checkpoint"] is not None
    built = [e["data"] for e in embedded.events(second["id"]) if e["type"] == "environment"]
    assert [(e["status"], e.get("reused")) for e in built] == [("preparing", None), ("ready", True)]


def test_a_failed_environment_fails_the_job_with_the_installers_reason(
    embedded: harness.Stack, tmp_path: Path
) -> None:
    spec = {
        "mode": "single",
        "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "digits"},
        "environment": {"pip": ["nosuchpackage-torchjobs-xyz==1.0"]},
        "max_retries": 2,
    }
    job = embedded.wait_job(embedded.submit(spec)["id"])
    assert job["state"] == "failed" and job["attempt"] == 1  # not retried
    assert job["error"].startswith("environment: ")
    assert "nosuchpackage-torchjobs-xyz" in job["error"] and "not found" in job["error"]
    with embedded.client() as c:
        log = c.get(f"/v1/jobs/{job['id']}/logs").text
    assert "environment: building for nosuchpackage-torchjobs-xyz==1.0" in log
