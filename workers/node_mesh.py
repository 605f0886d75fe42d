"""A multi-node job's nodes meet (contract §7 v3, `TORCHJOBS_JOB_NETWORK` `routed` or the
`private` mode on a root worker).

Each node's ranks run in a network namespace of their own, as a single-node job's do, with a
veth from its host's job subnet (`TORCHJOBS_JOB_SUBNET`, else the /24 the control plane gave
the host: service.hosts.subnets). Before any of its ranks starts, a node makes that
veth (so its address is known), says the address on its row, waits until every node of the
attempt has said one, then opens the job's mesh on its host (job_mesh.py): its elements in the
host's walls, and a /32 route to each node on another host through that host's address.
Node 0's address is the rendezvous. No other job, and nothing of any host,
is reachable from the ranks (job_network.py). Routed, the world is, as for single-node jobs,
through nftables' walls; private (no nftables needed), a node's namespace has a route to each
of its peers and to nothing else, so there is nothing to wall.

Why addresses published through the database rather than derived: the worker hosts know each
other only through the control plane, and a /30 is taken on its host by whichever node makes
the veth first (several workers may share a host). A host's subnet must be its own in the
cluster, and an IPv4 `--address`: a remote peer whose address this host holds or could hand
out is refused, and the node fails saying so.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import time
from dataclasses import dataclass

from service.nodes import reports
from service.nodes.mesh import MeshNode, mesh_of, publish_address
from service.nodes.values import NodeKey
from service.states import JobState
from workers.context import WorkerContext
from workers.launcher import job_mesh, job_network

LOOK_S = 0.5  # between looks at the other nodes' rows while they make their veths
CONTROL_EVERY_S = 1.0  # a job cancelled meanwhile ends the wait


class MeshFailed(Exception):
    """The nodes did not all meet in time (retried, as a rendezvous that fails), or their
    hosts' subnets overlap (not: the same hosts would fail the same way)."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass
class JoinedMesh:
    veth: job_network.Attached
    mesh: job_mesh.Mesh | None
    master_address: str
    hosts: tuple[tuple[str, str], ...] = ()  # each node's address and a name, for /etc/hosts

    def close(self) -> None:
        if self.mesh is not None:
            self.mesh.close()
        job_network.release(self.veth)


def join(ctx: WorkerContext, key: NodeKey, timeout_s: float) -> JoinedMesh:
    """This node's veth, its address said, every other node's awaited, the mesh opened."""
    subnet, walled = ctx.job_subnet, ctx.job_network == "routed"
    assert subnet is not None, "a mesh is joined only where the worker has a job subnet"
    elements = walled or ctx.mesh_elements
    try:
        veth = job_network.reserve(subnet, elements, sealed=not walled)
    except job_network.NetworkUnavailable as exc:
        raise MeshFailed(f"its network could not be made: {exc}") from exc
    joined = JoinedMesh(veth=veth, mesh=None, master_address=veth.job_address)
    try:
        publish_address(ctx.db, key, veth.job_address)
        nodes = _await_all(ctx, key, timeout_s)
        joined.master_address = nodes[0].job_address
        joined.hosts = _hosts(key, nodes)
        peers = _peers(key, nodes, subnet)
        joined.veth = dataclasses.replace(veth, peers=tuple(p.job_address for p in peers))
        joined.mesh = job_mesh.Mesh(veth, peers, elements)
        joined.mesh.open()
    except job_network.NetworkUnavailable as exc:
        joined.close()
        raise MeshFailed(f"its mesh could not be opened: {exc}") from exc
    except BaseException:
        joined.close()
        raise
    return joined


def _hosts(key: NodeKey, nodes: list[MeshNode]) -> tuple[tuple[str, str], ...]:
    """Each node's address and a name; this node's own also under the host's name, which the
    sandbox keeps (torchrun and c10d resolve it, and the host's resolver is walled off)."""
    names = {n.node_rank: f"torchjobs-node-{n.node_rank}" for n in nodes}
    names[key.node_rank] += f" {socket.gethostname()}"
    return tuple((n.job_address, names[n.node_rank]) for n in nodes)


def _await_all(ctx: WorkerContext, key: NodeKey, timeout_s: float) -> list[MeshNode]:
    deadline = time.monotonic() + timeout_s
    next_control = 0.0
    while True:
        known, missing = mesh_of(ctx.db, key)
        if not missing:
            return known
        now = time.monotonic()
        if now >= deadline:
            raise MeshFailed(f"nodes {missing} never said their network address in {timeout_s:.0f} s")
        if now >= next_control:
            next_control = now + CONTROL_EVERY_S
            _still_wanted(ctx, key)
        time.sleep(LOOK_S)


def _still_wanted(ctx: WorkerContext, key: NodeKey) -> None:
    if ctx.shutdown.is_set():
        raise MeshFailed("the worker is shutting down")
    control = reports.job_control(ctx.db, key.job_id)
    if control is None or control.attempt != key.attempt or control.state != JobState.RUNNING:
        raise MeshFailed("the attempt ended while its nodes met")


def _peers(key: NodeKey, nodes: list[MeshNode], subnet: str) -> list[job_mesh.Peer]:
    """The other nodes, each local (its worker on this host: same address, its /30 here) or
    remote (routed through its host). A remote address that this host holds or could hand out
    is refused: counted as local, or routed here, it would let the job into another job."""
    here = next(n.host_address for n in nodes if n.node_rank == key.node_rank)
    own = ipaddress.ip_network(subnet)
    on_host = job_network.local_job_networks()
    peers = []
    for node in nodes:
        if node.node_rank == key.node_rank:
            continue
        address = ipaddress.ip_address(node.job_address)
        held_here = address in own or any(address in net for net in on_host)
        if node.host_address == here:
            if not any(address in net for net in on_host):
                raise MeshFailed(f"node {node.node_rank}'s network ({address}) is gone from this host")
        elif held_here:
            raise MeshFailed(
                f"node {node.node_rank}'s address {address} (on host {node.host_address}) is in this "
                f"host's job subnet {subnet} or on one of its job veths: each worker host needs a job "
                "subnet of its own (leave TORCHJOBS_JOB_SUBNET unset: the control plane gives one)",
                retryable=False,
            )
        else:
            _routable(node)
        peers.append(job_mesh.Peer(node.job_address, node.host_address, node.host_address == here))
    return peers


def _routable(node: MeshNode) -> None:
    try:
        ipaddress.IPv4Address(node.host_address)
    except ValueError:
        raise MeshFailed(
            f"node {node.node_rank}'s worker address {node.host_address!r} is not an IPv4 address: a "
            "multi-node job's own network is routed through it (give workers --address as one)",
            retryable=False,
        ) from None
