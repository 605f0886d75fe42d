"""A routed multi-node job's addresses (contract §7 v3): each node says where its own network
namespace is, and learns where the others' are (node 0's is the rendezvous)."""

from __future__ import annotations

from dataclasses import dataclass

from service.db import Database
from service.jobs import repository as repo
from service.nodes.values import NodeKey


@dataclass(frozen=True)
class MeshNode:
    node_rank: int
    host_address: str  # its worker host's
    job_address: str  # its own, in its network namespace


def publish_address(db: Database, key: NodeKey, job_address: str) -> None:
    with db.transaction() as session:
        repo.set_job_address(session, key.job_id, key.attempt, key.node_rank, job_address)


def mesh_of(db: Database, key: NodeKey) -> tuple[list[MeshNode], list[int]]:
    """The nodes that said where they are, and the ranks of those that have not yet."""
    with db.read() as session:
        rows = repo.job_addresses(session, key.job_id, key.attempt)
    known = [MeshNode(rank, host, job) for rank, host, job in rows if job is not None]
    return known, [rank for rank, _host, job in rows if job is None]
