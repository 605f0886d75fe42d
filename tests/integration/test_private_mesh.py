"""Contract §7 v3 for multi-node jobs in a network of their own, `private` (a route to each of
the job's other nodes and nothing else) and the default (`auto`, routed where nftables is, as in
CI), through a real stack (PostgreSQL, Redis, two real warm workers running as root on one
host, the real sandbox): each node has a network namespace of its own, its ranks forked warm.
The nodes meet at node 0's own address and all-reduce; neither reaches a service listening on
the host (on all its addresses, through the host's end of its own veth, or on its loopback,
which is the node's own). Two hosts: tests/integration/test_routed_network.py."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from service.testing import harness
from service.testing.harness import Stack
from tests.integration.test_routed_network import probes_of
from tests.workers.launcher.test_job_network import host_service

__all__ = ["host_service"]  # the fixture: a service of the host's own, on all its addresses

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="a multi-node job's own network needs a root worker"
)


@pytest.fixture(params=["private", "auto"])
def stack(request: pytest.FixtureRequest, tmp_path: Path, pg_url: str, redis_url: str) -> Iterator[Stack]:
    """Two warm workers: `private`, and the default (`auto`: routed, where nftables is, as in
    CI): each node's ranks are forked from its worker's spare sandbox (#42), whose agent waits
    for the veth moved in at hand-over."""
    s = harness.production_stack(
        tmp_path, pg_url, redis_url, workers={"m1": 1, "m2": 1}, TORCHJOBS_JOB_NETWORK=request.param
    )
    yield s
    s.stop()


def host_address() -> str:
    """The host's own address on its outward interface (where its services also listen)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: it picks the route's source address
        return s.getsockname()[0]


def test_a_two_node_job_meets_over_its_own_addresses_and_reaches_no_host_service(
    stack: Stack, pg_url: str, host_service: int
) -> None:
    pg_port = urlparse(pg_url).port or 5432
    here = host_address()
    walled = [f"{here}:{host_service}", f"VIA:{host_service}", f"VIA:{pg_port}", f"{here}:{pg_port}"]
    # through its interface bound by name, where the kernel takes any address for one on the
    # link: the sealed host end answers no ARP, so still nothing (contract §7 v3)
    walled += [f"BOUND:{here}:{host_service}", f"BOUND:VIA:{host_service}", f"BOUND:{here}:{pg_port}"]
    harness.wait_warm_ranks(stack, spares=2)
    job = stack.submit(
        {
            "mode": "ddp",
            "nodes": 2,
            "gpus_per_node": 1,
            "entrypoint": {
                "kind": "script",
                "path": "mesh_probe.py",
                "args": [*walled, f"127.0.0.1:{pg_port}"],
            },
        }
    )
    done = stack.wait_job(job["id"], timeout=240)
    assert done["state"] == "succeeded", stack.describe(job["id"])
    assert {a["worker"] for a in done["assignments"]} == {"m1", "m2"}
    seen = probes_of(stack, job["id"])
    assert seen[0]["sum"] == seen[1]["sum"] == 3.0, seen
    assert seen[0]["warm"] and seen[1]["warm"], seen  # both nodes' ranks forked warm
    # node 0's own address, in the /24 the control plane gave this host (service/hosts/subnets.py)
    assert seen[0]["master"].startswith("10.213.0."), seen
    assert seen[1]["peer"] == "peer", seen  # its own other node, at that node's own address
    for node in (0, 1):
        for target in walled:
            assert seen[node][target] in ("OSError", "TimeoutError"), (node, target, seen)
        # the loopback is the node's own: nothing of the host's listens there
        assert seen[node][f"127.0.0.1:{pg_port}"] == "ConnectionRefusedError", seen
    # and the control (a test of the test): the host's service answers from the host
    with socket.create_connection((here, host_service), timeout=5) as conn:
        assert conn.recv(16) == b"host"
