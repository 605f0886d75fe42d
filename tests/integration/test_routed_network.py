"""Contract §7 v3 in the routed network (`TORCHJOBS_JOB_NETWORK=routed`, and the default where
the worker is root and has nftables), through a real stack (PostgreSQL, Redis, a
real worker running as root, the real sandbox): a job reaches a "world" host beyond this one
and neither the host's PostgreSQL (on its loopback, its gateway or its world-side address)
nor a private range; a DDP job still meets on its own loopback and trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from service.testing import harness
from service.testing.harness import Stack, script_job
from tests.integration.test_multinode import two_hosts
from tests.workers.launcher.test_job_network import WORLD, WORLD_GATEWAY, WORLD_PORT, world

__all__ = ["two_hosts", "world"]  # the fixtures: two hosts in namespaces; a host beyond this one
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a routed job network needs a root worker")


@pytest.fixture
def stack(tmp_path: Path, pg_url: str, redis_url: str, world: str) -> Iterator[Stack]:
    # the default, `auto`: routed on a root worker with nftables (CI installs it)
    s = harness.production_stack(tmp_path, pg_url, redis_url, workers={"r1": 2})
    yield s
    s.stop()


def probe(stack: Stack, *targets: str) -> dict[str, str]:
    job = stack.submit(script_job("net_probe.py", *targets))
    done = stack.wait_job(job["id"], timeout=120)
    assert done["state"] == "succeeded", stack.describe(job["id"])
    with stack.client() as c:
        log = c.get(f"/v1/jobs/{job['id']}/logs", params={"node": 0, "rank": 0}).text
    line = next(x for x in log.splitlines() if x.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))


def test_a_job_reaches_the_world_but_no_host_service(stack: Stack, pg_url: str) -> None:
    pg_port = urlparse(pg_url).port or 5432
    world_target = f"{WORLD}:{WORLD_PORT}"
    walled = (f"GATEWAY:{pg_port}", f"{WORLD_GATEWAY}:{pg_port}", "10.255.255.1:80")
    seen = probe(stack, world_target, f"127.0.0.1:{pg_port}", *walled)
    assert seen[world_target] == "world", seen
    assert seen[f"127.0.0.1:{pg_port}"] == "ConnectionRefusedError", seen  # its own loopback
    # its look-ups go to the worker's relay on its own loopback, which holds the port and
    # passes plain queries only (workers/launcher/dns_relay.py)
    assert (seen["resolver"], seen["not_a_query"]) == ("127.0.0.11", "TimeoutError"), seen
    for target in walled:
        assert seen[target] in ("TimeoutError", "OSError"), (target, seen)


def test_a_ddp_job_meets_on_its_own_loopback_and_trains(stack: Stack) -> None:
    job = stack.submit(
        {
            "mode": "ddp",
            "gpus_per_node": 2,
            "entrypoint": {"kind": "builtin", "model": "mlp", "dataset": "synthetic"},
            "hyperparameters": {"epochs": 1, "synthetic_size": 256, "num_workers": 0},
        }
    )
    done = stack.wait_job(job["id"], timeout=180)
    assert done["state"] == "succeeded", stack.describe(job["id"])


def probes_of(stack: Stack, job_id: int) -> dict[int, dict[str, Any]]:
    """What rank 0 of each of a job's two nodes saw (mesh_probe.py's PROBE line)."""
    seen = {}
    with stack.client() as c:
        for node in (0, 1):
            log = c.get(f"/v1/jobs/{job_id}/logs", params={"node": node, "rank": 0}).text
            line = next(x for x in log.splitlines() if x.startswith("PROBE "))
            seen[node] = json.loads(line.removeprefix("PROBE "))
    return seen


HOST_LISTENER = r"""
import socket
s = socket.create_server(("0.0.0.0", 9000))
while True:
    c, _ = s.accept(); c.sendall(b"host"); c.close()
"""


ROUTED_HOSTS = {"routed": ("hosta", "hostb"), "private": (), "mixed": ("hosta",)}


@pytest.mark.parametrize("network", list(ROUTED_HOSTS))
def test_a_two_host_job_meets_over_its_own_addresses_and_reaches_no_host(two_hosts, network: str) -> None:
    """Two hosts (network namespaces): routed, each worker with a job subnet its admin gave it;
    private, each with the /24 the control plane gave its address; mixed, one of each (what
    `auto` gives a cluster whose hosts differ in having nftables). The job's two nodes meet at
    node 0's own address and all-reduce; neither reaches a service on either host (a listener
    on host a, host b's address, PostgreSQL through the LAN gateway)."""
    stack, net, env = two_hosts
    addresses = {}
    for index, name in enumerate(("hosta", "hostb")):
        addresses[name] = net.add_host(name)
        if name in ROUTED_HOSTS[network]:
            extra = {**env, "TORCHJOBS_JOB_NETWORK": "routed", "TORCHJOBS_JOB_SUBNET": f"10.240.{index}.0/24"}
        else:
            extra = {**env, "TORCHJOBS_JOB_NETWORK": "private"}
        stack.start_worker(name, 1, address=addresses[name], extra_env=extra, netns=net.namespace(name))
    listener = subprocess.Popen(
        ["ip", "netns", "exec", net.namespace("hosta"), sys.executable, "-c", HOST_LISTENER]
    )
    try:
        pg = f"{net.gateway}:{urlparse(env['TORCHJOBS_DATABASE_URL']).port}"
        walled = [f"{addresses['hosta']}:9000", f"{addresses['hostb']}:9000", pg, "VIA:9000"]
        walled += [f"BOUND:{addresses['hosta']}:9000", "BOUND:VIA:9000"]
        job = stack.submit(
            {
                "mode": "ddp",
                "nodes": 2,
                "gpus_per_node": 1,
                "entrypoint": {"kind": "script", "path": "mesh_probe.py", "args": walled},
            }
        )
        done = stack.wait_job(job["id"], timeout=240)
        assert done["state"] == "succeeded", stack.describe(job["id"])
        seen = probes_of(stack, job["id"])
    finally:
        listener.kill()
        listener.wait()
    assert seen[0]["sum"] == seen[1]["sum"] == 3.0, seen
    node0_host = next(a["worker"] for a in done["assignments"] if a["node_rank"] == 0)
    if node0_host in ROUTED_HOSTS[network]:  # its admin's subnet
        prefix = f"10.240.{('hosta', 'hostb').index(node0_host)}."
    else:  # the pool's blocks, given in the order the pooled hosts' workers started
        pooled = [h for h in ("hosta", "hostb") if h not in ROUTED_HOSTS[network]]
        prefix = env["TORCHJOBS_JOB_SUBNET_POOL"].removesuffix("0.0/16") + f"{pooled.index(node0_host)}."
    assert seen[0]["master"].startswith(prefix), seen
    assert seen[1]["peer"] == "peer", seen  # its own other node, at that node's own address
    for node in (0, 1):  # a routed node resolves through its worker's relay; a private one has no route
        host = next(a["worker"] for a in done["assignments"] if a["node_rank"] == node)
        assert (seen[node]["resolver"] == "127.0.0.11") == (host in ROUTED_HOSTS[network]), (node, seen)
    for node in (0, 1):
        for target in walled:
            assert seen[node][target] in ("TimeoutError", "OSError"), (node, target, seen)
