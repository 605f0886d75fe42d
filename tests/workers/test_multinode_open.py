"""Whether a worker takes every user's multi-node jobs (contract §7 v3), as it registers."""

from __future__ import annotations

from tests.workers.launcher.test_job_network import worker
from workers.agent import multinode_open_to_all
from workers.context import WorkerContext
from workers.launcher.sandbox import UNISOLATED, Isolation

USERNS = Isolation(kind="sandbox", method="bwrap-userns", bwrap="/usr/bin/bwrap")


def _worker(iso: Isolation, node_meshes: bool, **settings: str) -> WorkerContext:
    ctx = worker(iso, **settings)
    ctx.node_meshes = node_meshes
    return ctx


def test_a_worker_whose_multi_node_jobs_keep_the_host_network_takes_only_the_admins() -> None:
    assert not multinode_open_to_all(_worker(USERNS, node_meshes=False))  # a normal user's
    assert multinode_open_to_all(_worker(USERNS, node_meshes=True))  # a root worker's meshes
    assert multinode_open_to_all(_worker(USERNS, node_meshes=False, allow_host_network="true"))
    assert multinode_open_to_all(_worker(USERNS, node_meshes=False, job_network="host"))  # chosen
    assert multinode_open_to_all(_worker(UNISOLATED, node_meshes=False))  # closed as a whole instead


def test_a_worker_says_whether_its_multi_node_jobs_nodes_get_networks_of_their_own() -> None:
    """The scheduler never splits one job between the two kinds (placement.one_network_kind)."""
    root = Isolation(kind="sandbox", method="bwrap-setuid", bwrap="/usr/bin/bwrap", uid=1, gid=1)
    assert _worker(root, node_meshes=True).meshes
    assert not _worker(USERNS, node_meshes=False, allow_host_network="true").meshes
    assert not _worker(UNISOLATED, node_meshes=True).meshes  # unsandboxed: the host's network
