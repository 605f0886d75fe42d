"""A user's own code, end to end (contract §6): a folder with a torchrun-style DDP script, a
local module, a `workers` package of its own and a factory module, packed and uploaded by
`torchjobs submit --workdir`, run by a real worker in a sandbox, in a private copy."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import service
from service.client.api import Client
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
    assert "tabulate 0.10.0 from " in log and "/environments/" in log
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


# ---------------------------------------------------------------- an environment that cannot be built

PROBE = """
import torch
import tabulate
from workers.runtime import report

print(f"probe: torch {torch.__version__}, tabulate {tabulate.__version__} from {tabulate.__file__}")
report(epoch=1, epochs=1)
"""


def test_a_requirement_that_needs_another_torch_fails_its_job_and_not_its_neighbour(
    embedded: harness.Stack, tmp_path: Path
) -> None:
    """torchvision 0.19.0 pins torch==2.4.0 through its own dependencies; the worker's torch is
    another, so the build finds no solution. That job fails with uv's reason; a job submitted
    beside it, on the same worker, builds its own environment and runs."""
    import torch  # the worker's, from this very virtual environment

    folder = tmp_path / "neighbour"
    folder.mkdir()
    (folder / "probe.py").write_text(PROBE)
    with Client(embedded.url, harness.ADMIN_TOKEN) as client:
        code = client.push_code(folder)["id"]
    other_torch = {
        "name": "needs-torch-2.4",
        "mode": "single",
        "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "digits"},
        "environment": {"pip": ["torchvision==0.19.0"]},
        "max_retries": 2,
    }
    neighbour = {
        "name": "neighbour",
        "mode": "single",
        "code": code,
        "entrypoint": {"kind": "script", "path": "probe.py", "args": []},
        "environment": {"pip": ["tabulate==0.10.0"]},
    }
    envs = embedded.home / "cache" / "environments"
    envs_before = {p for p in envs.glob("*") if not p.name.startswith(".")}
    bad, good = embedded.submit(other_torch), embedded.submit(neighbour)  # together, one worker
    failed, done = embedded.wait_job(bad["id"]), embedded.wait_job(good["id"])

    assert failed["state"] == "failed" and failed["attempt"] == 1, failed  # not retried
    assert failed["error"].startswith("environment: "), failed["error"]
    assert "torch==2.4.0" in failed["error"] and f"torch=={torch.__version__}" in failed["error"]
    assert "unsatisfiable" in failed["error"]  # uv's own words, not ours
    built = [e["data"]["status"] for e in embedded.events(bad["id"]) if e["type"] == "environment"]
    assert built == ["preparing"]  # never ready: no rank started

    assert done["state"] == "succeeded", embedded.describe(good["id"])
    assert [a["worker"] for a in failed["assignments"] + done["assignments"]] == ["local", "local"]
    with embedded.client() as c:
        log = c.get(f"/v1/jobs/{good['id']}/logs").text
    found = re.search(rf"probe: torch {re.escape(torch.__version__)}, tabulate 0.10.0 from (\S+)", log)
    assert found, log  # the worker's torch, still
    neighbours_env = Path(found[1]).parents[2]  # ENVS/KEY/site/tabulate/__init__.py
    assert neighbours_env.parent == envs
    # nothing of the failed build was kept: no folder but the neighbour's, no staging
    assert {p for p in envs.glob("*") if not p.name.startswith(".")} == envs_before | {neighbours_env}
    assert not list(envs.glob(".*building*"))
    worker = embedded.worker("local")
    assert worker is not None and worker["state"] == "online"  # the job's fault, not the host's


# ---------------------------------------------------------------- a `service` package of the job's own

SERVICE_SCRIPT = """
import importlib.machinery
import os
import sys

import service
import service.config
from workers.runtime import report

here = os.path.realpath(os.getcwd())
print(f"mine: {service.WHO}; {service.config.WHO}", flush=True)
print(f"service from {service.__file__}; config from {service.config.__file__}; cwd={here}", flush=True)
assert os.path.dirname(os.path.dirname(os.path.realpath(service.__file__))) == here, service.__file__

# could torchjobs' own `service` have been imported here? (the editable install's finder)
machinery = importlib.machinery
standard = (machinery.BuiltinImporter, machinery.FrozenImporter, machinery.PathFinder)
ours = None
for finder in sys.meta_path:
    if not isinstance(finder, type) or not issubclass(finder, standard):
        spec = finder.find_spec("service", None)
        if spec is not None and spec.origin and os.path.exists(spec.origin):
            ours = spec.origin
print(f"torchjobs' service findable: {ours}", flush=True)
report(epoch=1, epochs=1)
"""

SERVICE_FACTORY = FACTORY + "\nWHO = 'their service.models'\n"


def _service_project(root: Path) -> Path:
    folder = root / "svcproj"
    (folder / "service").mkdir(parents=True)
    (folder / "service" / "__init__.py").write_text("WHO = 'their own service package'\n")
    (folder / "service" / "config.py").write_text("WHO = 'their own service.config'\n")  # ours has one too
    (folder / "service" / "models.py").write_text(SERVICE_FACTORY)  # and this one
    (folder / "train.py").write_text(SERVICE_SCRIPT)
    return folder


def _runs_their_own_service(stack: harness.Stack, folder: Path) -> str:
    """Both ways a job's code is imported: a script, and a factory "module:callable"."""
    with Client(stack.url, harness.ADMIN_TOKEN) as client:
        code = client.push_code(folder)["id"]
    script = {"kind": "script", "path": "train.py", "args": []}
    factory = {"kind": "factory", "model": "service.models:model", "dataset": "service.models:data"}
    hyper = {"epochs": 1, "batch_size": 8, "num_workers": 0}
    jobs = [
        stack.submit({"mode": "single", "code": code, "entrypoint": script}),
        stack.submit({"mode": "single", "code": code, "entrypoint": factory, "hyperparameters": hyper}),
    ]
    for job in jobs:
        done = stack.wait_job(job["id"])
        assert done["state"] == "succeeded", stack.describe(job["id"])
    with stack.client() as c:
        log = c.get(f"/v1/jobs/{jobs[0]['id']}/logs").text
    assert "mine: their own service package; their own service.config" in log, log
    return log


def test_a_service_package_of_the_jobs_own_is_the_one_imported(
    embedded: harness.Stack, tmp_path: Path
) -> None:
    log = _runs_their_own_service(embedded, _service_project(tmp_path))
    assert "service from /job/workdir/service/__init__.py" in log


def test_a_service_package_of_the_jobs_own_wins_where_ours_is_importable_too(tmp_path: Path) -> None:
    """The control: on an unsandboxed worker the ranks could import torchjobs' own `service`
    (the source tree is not walled off); the job's still wins."""
    home = tmp_path / "home"
    home.mkdir()
    stack = harness.embedded_stack(home, harness.make_env(home, TORCHJOBS_SANDBOX="off"))
    try:
        log = _runs_their_own_service(stack, _service_project(tmp_path))
    finally:
        stack.stop()
    ours = Path(service.__file__).resolve()
    assert f"torchjobs' service findable: {ours}" in log  # it was there to be found...
    assert f"service from {ours}" not in log  # ...and not taken


# ---------------------------------------------------------------- code ls, list_code, no second upload


REQUESTS = "torchjobs_http_request_duration_seconds"


def _code_requests(stack: harness.Stack) -> dict[tuple[str, str], float]:
    """The server's own count of requests to /v1/code and /v1/code/{code_id}, by (method, route),
    from its request metrics (one API process: `torchjobs up`)."""
    with stack.client() as c:
        text = c.get("/metrics").text
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            route = sample.labels.get("route", "")
            if sample.name == f"{REQUESTS}_count" and route.startswith("/v1/code"):
                key = (sample.labels["method"], route)
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def _delta(after: dict[tuple[str, str], float], before: dict[tuple[str, str], float]) -> dict[str, float]:
    return {f"{m} {r}": n - before.get((m, r), 0.0) for (m, r), n in after.items() if n != before.get((m, r))}


def test_code_ls_list_code_and_a_second_submit_uploads_nothing(
    embedded: harness.Stack, tmp_path: Path
) -> None:
    with embedded.client() as admin:
        token = admin.post("/v1/users", json={"name": "lister"}).json()["token"]
    folder = tmp_path / "listed"
    folder.mkdir()
    (folder / "probe.py").write_text("print('listed ran')\n")
    (folder / "job.yaml").write_text(
        "mode: single\nentrypoint:\n  kind: script\n  path: probe.py\n  args: []\n"
    )
    job_yaml = str(folder / "job.yaml")
    assert json.loads(cli(embedded, token, "code", "ls", "-o", "json")) == {"items": []}

    before = _code_requests(embedded)
    first = int(cli(embedded, token, "submit", job_yaml, "--workdir", str(folder)))
    after_first = _code_requests(embedded)
    second = int(cli(embedded, token, "submit", job_yaml, "--workdir", str(folder)))
    after_second = _code_requests(embedded)
    # the first submit asks whether the server has these bytes (404), then sends them;
    # the second asks (200) and sends nothing
    assert _delta(after_first, before) == {"GET /v1/code/{code_id}": 1, "POST /v1/code": 1}
    assert _delta(after_second, after_first) == {"GET /v1/code/{code_id}": 1}

    with embedded.client(token) as c:
        jobs = [c.get(f"/v1/jobs/{j}").json() for j in (first, second)]
    assert jobs[0]["code"] == jobs[1]["code"] is not None
    with Client(embedded.url, token) as client:
        listed = client.list_code()
        assert [c["id"] for c in listed] == [jobs[0]["code"]]
        assert (listed[0]["name"], listed[0]["owner"], listed[0]["files"]) == ("listed", "lister", 2)
        with Client(embedded.url, harness.ADMIN_TOKEN) as admins:
            assert jobs[0]["code"] not in [c["id"] for c in admins.list_code()]  # the caller's own only
        (folder / "probe.py").write_text("print('listed ran, changed')\n")
        newer = client.push_code(folder, name="listed-v2")
        assert [c["id"] for c in client.list_code()] == [newer["id"], jobs[0]["code"]]  # newest first
        everything = client.list_code()
    assert json.loads(cli(embedded, token, "code", "ls", "--output", "json")) == {"items": everything}
    table = cli(embedded, token, "code", "ls")
    lines = [line for line in table.splitlines() if newer["id"][:12] in line or jobs[0]["code"][:12] in line]
    assert len(lines) == 2 and "listed-v2" in lines[0] and "listed" in lines[1], table
    assert str(newer["files"]) in lines[0] and str(newer["size_bytes"]) in lines[0]
    for job_id in (first, second):
        assert embedded.wait_job(job_id)["state"] == "succeeded", embedded.describe(job_id)


# ---------------------------------------------------------------- a framework over the worker's torch

HF_TRAINER = Path(__file__).resolve().parents[1] / "sandbox_code" / "hf_trainer"


def test_a_hugging_face_trainer_job_builds_its_environment_over_the_workers_torch(
    embedded: harness.Stack,
) -> None:
    """transformers and accelerate depend on torch; this worker's torch is a local `+cpu` wheel
    no index holds, and the stack sets no installer arguments (#37). The environment builds
    over the installed torch and the Trainer trains."""
    with Client(embedded.url, harness.ADMIN_TOKEN) as client:
        code = client.push_code(HF_TRAINER)["id"]
    spec = {
        "name": "hf-trainer",
        "mode": "single",
        "code": code,
        "entrypoint": {"kind": "script", "path": "train.py"},
        "environment": {"pip": ["transformers==5.25.0", "accelerate==1.15.0"]},
    }
    job = embedded.wait_job(embedded.submit(spec)["id"], timeout=600)
    assert job["state"] == "succeeded", embedded.describe(job["id"])
    with embedded.client() as c:
        log = c.get(f"/v1/jobs/{job['id']}/logs").text
    assert "hf-trainer done: steps=8" in log, log[-3000:]
    assert "environment: building for transformers==5.25.0, accelerate==1.15.0" in log
