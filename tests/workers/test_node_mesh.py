"""Which of a routed multi-node job's nodes a node lets its ranks reach, and how (contract §7
v3): a peer is local only when its worker is on this host, and a remote peer whose address
this host holds or hands out is refused (counted as local, or routed here, it would be
another job's veth)."""

from __future__ import annotations

import ipaddress

import pytest

from service.nodes.mesh import MeshNode
from service.nodes.values import NodeKey
from workers import node_mesh
from workers.launcher import job_network

SUBNET = "10.213.0.0/16"
KEY = NodeKey(job_id=7, attempt=1, node_rank=0)


@pytest.fixture
def veths_here(monkeypatch: pytest.MonkeyPatch) -> list[ipaddress.IPv4Network]:
    nets = [ipaddress.IPv4Network("10.213.0.4/30"), ipaddress.IPv4Network("10.213.0.8/30")]
    monkeypatch.setattr(job_network, "local_job_networks", lambda: nets)
    return nets


def test_a_peer_is_local_by_its_host_and_remote_ones_are_routed(veths_here: list) -> None:
    nodes = [
        MeshNode(0, "192.0.2.1", "10.213.0.6"),
        MeshNode(1, "192.0.2.1", "10.213.0.10"),  # another worker of this host
        MeshNode(2, "192.0.2.2", "10.214.0.6"),
    ]
    peers = node_mesh._peers(KEY, nodes, SUBNET)
    assert [(p.job_address, p.local) for p in peers] == [("10.213.0.10", True), ("10.214.0.6", False)]


def test_a_remote_address_held_here_is_refused_not_taken_for_a_local_one(veths_here: list) -> None:
    """Hosts sharing a subnet: the remote node's address is another job's veth on this host."""
    nodes = [MeshNode(0, "192.0.2.1", "10.213.0.6"), MeshNode(1, "192.0.2.2", "10.213.0.10")]
    with pytest.raises(node_mesh.MeshFailed, match="subnet of its own") as caught:
        node_mesh._peers(KEY, nodes, SUBNET)
    assert not caught.value.retryable
    elsewhere = [MeshNode(0, "192.0.2.1", "10.213.0.6"), MeshNode(1, "192.0.2.2", "10.213.99.2")]
    with pytest.raises(node_mesh.MeshFailed, match="subnet of its own"):
        node_mesh._peers(KEY, elsewhere, SUBNET)  # not held yet, but this host could hand it out


def test_a_worker_address_that_is_no_ip_cannot_be_routed_through(veths_here: list) -> None:
    nodes = [MeshNode(0, "192.0.2.1", "10.213.0.6"), MeshNode(1, "gpu-7.example", "10.214.0.6")]
    with pytest.raises(node_mesh.MeshFailed, match="not an IPv4 address"):
        node_mesh._peers(KEY, nodes, SUBNET)


def test_a_local_peer_whose_veth_is_gone_is_said_so(veths_here: list) -> None:
    nodes = [MeshNode(0, "192.0.2.1", "10.213.0.6"), MeshNode(1, "192.0.2.1", "10.213.0.42")]
    with pytest.raises(node_mesh.MeshFailed, match="gone from this host") as caught:
        node_mesh._peers(KEY, nodes, SUBNET)
    assert caught.value.retryable
