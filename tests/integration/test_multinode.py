"""Issue 6: gang placement, GPU accounting and DDP across hosts, with real processes.

The two-host tests put each worker in its own network namespace with its own address
(tests/netns.py): rendezvous and gloo traffic really cross a (virtual) network. They need
`ip netns`, which CI has (it runs as root); elsewhere they fail loudly rather than skip.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

from service.testing import harness
from service.testing.harness import Stack, pids_of_job, wait_for
from service.testing.netns import Network, netns_available

DIGITS = {"kind": "builtin", "model": "cnn", "dataset": "digits"}
SMALL = {"kind": "builtin", "model": "mlp", "dataset": "synthetic"}
TWO_NODES_ONE_GPU = {
    "mode": "ddp",
    "nodes": 2,
    "gpus_per_node": 1,
    "entrypoint": DIGITS,
    "hyperparameters": {"epochs": 1, "num_workers": 0},
}


def worker_env(stack: Stack, net: Network, pg_port: int, redis_port: int) -> dict[str, str]:
    """How a worker inside a namespace reaches PostgreSQL and Redis: through the forwarders."""
    db = urlparse(stack.env["TORCHJOBS_DATABASE_URL"])
    broker = urlparse(stack.env["TORCHJOBS_BROKER_URL"])
    return {
        "TORCHJOBS_DATABASE_URL": f"postgresql://{db.username}@{net.gateway}:{pg_port}{db.path}",
        "TORCHJOBS_BROKER_URL": f"redis://{net.gateway}:{redis_port}{broker.path}",
        "GLOO_SOCKET_IFNAME": "tj0",
    }


@pytest.fixture
def two_hosts(tmp_path: Path, pg_url: str, redis_url: str) -> Iterator[tuple[Stack, Network, dict[str, str]]]:
    if os.environ.get("CI") or netns_available():
        assert netns_available(), "network namespaces are needed for the two-host tests"
    else:
        pytest.fail("network namespaces are not available here")
    # a /24 of each xdist process's own: two processes' hosts on one subnet (two bridges in the
    # root namespace) would take each other's routes and forwarders
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    net = Network(tag=str(os.getpid() % 10000), subnet=f"10.231.{10 + worker}")
    net.up()
    stack = harness.production_stack(
        tmp_path, pg_url, redis_url, workers={}, warm=False, TORCHJOBS_RENDEZVOUS_TIMEOUT_S="20"
    )
    env = worker_env(stack, net, net.forward(5432), net.forward(6379))
    # the hosts' job subnets (multi-node jobs' own networks) out of every range the machine's
    # own jobs use: the bridge between the hosts runs through the root namespace, whose
    # torchjobs walls (br_netfilter) would masquerade 10.213/16 as it crosses
    env["TORCHJOBS_JOB_SUBNET_POOL"] = f"10.{232 + worker}.0.0/16"
    try:
        yield stack, net, env
    finally:
        stack.stop()
        net.down()


def test_ddp_across_two_hosts_with_world_size_four(two_hosts) -> None:
    stack, net, env = two_hosts
    for name in ("hosta", "hostb"):
        address = net.add_host(name)
        stack.start_worker(name, 2, address=address, extra_env=env, netns=net.namespace(name))
    job = stack.submit(
        {
            "mode": "ddp",
            "nodes": 2,
            "gpus_per_node": 2,
            "entrypoint": DIGITS,
            "hyperparameters": {"epochs": 1, "num_workers": 0},
        }
    )
    done = stack.wait_job(job["id"], timeout=300)
    assert done["state"] == "succeeded", done["error"]
    assert {a["worker"] for a in done["assignments"]} == {"hosta", "hostb"}
    assert sorted(a["node_rank"] for a in done["assignments"]) == [0, 1]
    with stack.client() as c:
        blob = c.get(done["latest_checkpoint"]["download_url"]).content
    meta = torch.load(io.BytesIO(blob), weights_only=True)["meta"]
    assert meta["world_size"] == 4


def test_wrong_master_address_fails_promptly_naming_the_node(two_hosts) -> None:
    stack, net, env = two_hosts
    good = net.add_host("hostb")
    wrong_ns = net.add_host("hosta")
    # node 0 is placed on "a-wrong" (best fit ties break by name); it announces an address
    # on the bridge that nobody holds, so no node can reach the rendezvous master there. On
    # the hosts' network, where the worker's address is the master's (a node of a job's own
    # network meets at its own address, and a failure names that one)
    env = {**env, "TORCHJOBS_JOB_NETWORK": "host"}
    stack.start_worker("a-wrong", 2, address=f"{net.subnet}.99", extra_env=env, netns=net.namespace("hosta"))
    stack.start_worker("b-good", 2, address=good, extra_env=env, netns=net.namespace("hostb"))
    assert wrong_ns
    started = time.monotonic()
    job = stack.submit(TWO_NODES_ONE_GPU)
    done = stack.wait_job(job["id"], timeout=120)
    elapsed = time.monotonic() - started
    assert done["state"] == "failed"
    # whichever node notices first, the diagnosis names it, its worker and the bad address
    assert "node 0 on worker a-wrong" in done["error"] or "node 1 on worker b-good" in done["error"], done[
        "error"
    ]
    assert f"{net.subnet}.99" in done["error"]
    assert elapsed < 20 + 40  # the rendezvous timeout plus start-up, not a collective's 30 minutes
    wait_for(lambda: pids_of_job(job["id"], stack.home) == [] or None, 30, "no process of the job left")
    with stack.client() as c:
        assert all(w["gpus_free"] == 2 for w in c.get("/v1/workers").json()["items"])


def test_broken_network_between_hosts_fails_in_the_preflight_naming_the_node(two_hosts) -> None:
    """Both nodes reach the rendezvous master, but host b's collectives are pointed at an
    interface on a network that host a routes into a black hole: gloo retries the connection
    ("timed out connecting: No route to host"), and without the pre-flight it would do so
    until the process group's 30-minute timeout, with the job showing `running`."""
    stack, net, env = two_hosts
    for name in ("hosta", "hostb"):
        address = net.add_host(name)
        # the host's network (where the hosts' own interfaces are the ranks'): a job node's own
        # network sets gloo's interface itself (eth0), so no worker setting can misdirect it
        host_env = {**env, "TORCHJOBS_PREFLIGHT_TIMEOUT_S": "10", "TORCHJOBS_JOB_NETWORK": "host"}
        if name == "hostb":
            net.add_isolated_interface(name, "tjx0", "10.99.0.2")
            host_env["GLOO_SOCKET_IFNAME"] = "tjx0"
        else:
            net.route(name, "10.99.0.0/24", f"{net.subnet}.250")
        stack.start_worker(name, 1, address=address, extra_env=host_env, netns=net.namespace(name))
    started = time.monotonic()
    job = stack.submit(TWO_NODES_ONE_GPU)
    done = stack.wait_job(job["id"], timeout=120)
    elapsed = time.monotonic() - started
    assert done["state"] == "failed", done
    assert "pre-flight could not connect to every other rank within 10 s" in done["error"], done["error"]
    assert "10.99.0.2" in done["error"]  # the unreachable peer, named by gloo
    assert "node 0 on worker hosta" in done["error"] or "node 1 on worker hostb" in done["error"]
    assert elapsed < 10 + 40, elapsed  # the pre-flight timeout plus start-up
    wait_for(lambda: pids_of_job(job["id"], stack.home) == [] or None, 30, "no process of the job left")
    with stack.client() as c:
        assert all(w["gpus_free"] == 1 for w in c.get("/v1/workers").json()["items"])


def test_mixed_queue_never_exceeds_any_host(tmp_path: Path, pg_url: str, redis_url: str) -> None:
    stack = harness.production_stack(tmp_path, pg_url, redis_url, workers={"w1": 2, "w2": 2}, warm=False)
    try:
        sizes = [(1, 2), (1, 1), (2, 2), (1, 2), (1, 1), (2, 2), (1, 1)]  # (nodes, gpus_per_node)
        jobs = []
        for nodes, gpus in sizes:
            mode = "ddp" if gpus > 1 or nodes > 1 else "single"
            jobs.append(
                stack.submit(
                    {
                        "mode": mode,
                        "nodes": nodes,
                        "gpus_per_node": gpus,
                        "entrypoint": SMALL,  # placement is what is tested: a short job
                        "hyperparameters": {"epochs": 1, "num_workers": 0, "synthetic_size": 256},
                    }
                )["id"]
            )
        peaks: dict[str, int] = {"w1": 0, "w2": 0}
        violations: list[str] = []
        stop = threading.Event()

        def sample() -> None:
            with stack.client() as c:
                while not stop.is_set():
                    items = c.get("/v1/jobs", params={"limit": 50}).json()["items"]
                    use: dict[str, int] = {}
                    for job in items:
                        if job["state"] in ("scheduled", "running", "cancelling"):
                            for a in job["assignments"]:
                                use[a["worker"]] = use.get(a["worker"], 0) + len(a["gpus"])
                    for host, n in use.items():
                        peaks[host] = max(peaks.get(host, 0), n)
                        if n > 2:
                            violations.append(f"{host} had {n} GPUs assigned")
                    time.sleep(0.2)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            finals = [stack.wait_job(j, timeout=400) for j in jobs]
        finally:
            stop.set()
            sampler.join()
        assert [f["state"] for f in finals] == ["succeeded"] * len(jobs), [f["error"] for f in finals]
        assert violations == []
        assert max(peaks.values()) == 2  # the hosts were really used to capacity at some point
        with stack.client() as c:
            assert all(w["gpus_free"] == 2 for w in c.get("/v1/workers").json()["items"])
    finally:
        stack.stop()


def test_more_gpus_per_node_than_any_worker_is_422(production: Stack) -> None:
    with production.client() as c:
        resp = c.post("/v1/jobs", json={"mode": "ddp", "gpus_per_node": 3, "entrypoint": DIGITS})
        assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "gpus_per_node"]
        resp = c.post("/v1/jobs", json={"mode": "ddp", "nodes": 2, "gpus_per_node": 1, "entrypoint": DIGITS})
        assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "nodes"]


def test_own_code_with_its_environment_across_two_hosts(two_hosts, tmp_path: Path) -> None:
    """Contract §6 on two hosts: each node unpacks the uploaded code, builds (or finds) the
    environment and runs the script in its own copy."""
    from service.client import Client
    from service.config import Settings
    from tests.integration.test_own_code import project
    from workers.environments import ensure_environment

    stack, net, env = two_hosts
    for name in ("hosta", "hostb"):
        stack.start_worker(name, 1, address=net.add_host(name), extra_env=env, netns=net.namespace(name))
    with Client(stack.url, harness.ADMIN_TOKEN) as client:
        code = client.push_code(project(tmp_path))
    # No registry is reachable from inside the namespaces: the set is built once from outside,
    # into the cache the two "hosts" share here, and each node finds it ready.
    ensure_environment(Settings(home=stack.home), ["tabulate==0.10.0"], tmp_path / "build.log")
    spec = {
        "mode": "ddp",
        "nodes": 2,
        "gpus_per_node": 1,
        "entrypoint": {"kind": "script", "path": "train.py", "args": []},
        "code": code["id"],
        "environment": {"pip": ["tabulate==0.10.0"]},
    }
    done = stack.wait_job(stack.submit(spec)["id"], timeout=300)
    assert done["state"] == "succeeded", stack.describe(done["id"])
    assert {a["worker"] for a in done["assignments"]} == {"hosta", "hostb"}
    with stack.client() as c:
        logs = [c.get(f"/v1/jobs/{done['id']}/logs", params={"node": n}).text for n in (0, 1)]
    for log in logs:
        assert "environment: reusing" in log and "their own workers package; their __init__ ran; 42" in log


def test_a_dcp_checkpoint_of_two_hosts_is_whole_and_resumes_on_one_rank(two_hosts, tmp_path: Path) -> None:
    """Contract §11 across hosts: builtin `fsdp` on two hosts, each rank's DCP shard saved on
    its own host; the listed checkpoint holds both hosts' files, downloaded it is a DCP folder
    DCP itself reads whole, and a job of 1 node and 1 rank resumes from it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    stack, net, env = two_hosts
    for name in ("hosta", "hostb"):
        stack.start_worker(name, 1, address=net.add_host(name), extra_env=env, netns=net.namespace(name))
    hyper = {"epochs": 2, "synthetic_size": 256, "batch_size": 32, "num_workers": 0, "checkpoint_every": 1}
    entry = {"kind": "builtin", "model": "mlp", "dataset": "synthetic"}
    spec = {"mode": "fsdp", "nodes": 2, "gpus_per_node": 1, "entrypoint": entry, "hyperparameters": hyper}
    done = stack.wait_job(stack.submit(spec)["id"], timeout=300)
    assert done["state"] == "succeeded", stack.describe(done["id"])
    assert {a["worker"] for a in done["assignments"]} == {"hosta", "hostb"}
    # node 0 lists a folder before it reports its end: a job that has succeeded shows its last one
    ckpt = done["latest_checkpoint"]
    assert ckpt is not None and ckpt["name"] == "epoch-0002", stack.describe(done["id"])
    assert ckpt["kind"] == "folder", ckpt
    folder = tmp_path / "dcp"
    with stack.client() as c:
        files = c.get(f"/v1/checkpoints/{ckpt['id']}/files").json()["items"]
        assert {f["node_rank"] for f in files} == {0, 1}, files
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {f["path"].rsplit("/", 1)[-1] for f in files}
        for f in files:
            target = folder / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(c.get(f"/v1/checkpoints/{ckpt['id']}/files/{f['path']}").content)
    metadata = next(folder.rglob(".metadata"))
    dcp_to_torch_save(metadata.parent, tmp_path / "whole.pt")  # fails on a missing shard
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert whole["model"], list(whole)
    resumed = stack.wait_job(
        stack.submit(
            {
                "mode": "fsdp",
                "gpus_per_node": 1,
                "entrypoint": entry,
                "hyperparameters": {**hyper, "epochs": 3},
                "resume_from": {"checkpoint_id": ckpt["id"]},
            }
        )["id"],
        timeout=300,
    )
    assert resumed["state"] == "succeeded", stack.describe(resumed["id"])
    with stack.client() as c:
        log = c.get(f"/v1/jobs/{resumed['id']}/logs").text
    assert "resuming at epoch 2" in log, log[-3000:]

    # a job of 1 rank reads the folder staged for it on its host: the same tensors, checksum
    # for checksum, as the two hosts' shards read together here
    def checksums(state: dict) -> dict[str, str]:  # type: ignore[type-arg]
        return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in state.items()}

    project = tmp_path / "reader"
    project.mkdir()
    (project / "read_dcp.py").write_text(
        "import hashlib, json, os, tempfile, torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "out = os.path.join(tempfile.mkdtemp(), 'whole.pt')\n"
        "dcp_to_torch_save(os.environ['TORCHJOBS_RESUME_FROM'], out)\n"
        "model = torch.load(out, weights_only=False)['model']\n"
        "sums = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in model.items()}\n"
        "print('SUMS ' + json.dumps(sums), flush=True)\n"
    )
    from service.client import Client

    with Client(stack.url, harness.ADMIN_TOKEN) as client:
        code = client.push_code(project)["id"]
    reader = stack.wait_job(
        stack.submit(
            {
                "mode": "single",
                "code": code,
                "entrypoint": {"kind": "script", "path": "read_dcp.py"},
                "resume_from": {"checkpoint_id": ckpt["id"]},
            }
        )["id"],
        timeout=300,
    )
    assert reader["state"] == "succeeded", stack.describe(reader["id"])
    with stack.client() as c:
        log = c.get(f"/v1/jobs/{reader['id']}/logs").text
    assert json.loads(log.split("SUMS ", 1)[1].splitlines()[0]) == checksums(whole["model"])
