"""A multi-node job's nodes let through to each other (contract §7 v3): what a node opens on
its host once it knows where its job's other nodes are (workers/node_mesh.py). A routed node's
elements and routes, as below; a private mesh's routes (the node's own routes, inside its
namespace, name its peers and nothing else: nothing to wall), and its elements too where the
host has nftables (a routed worker's walls, if one runs here, let only elements through).

- **Elements** in `peers_out` and `peers_in` (job_network.rules): each names this node's own
  host veth, so it is this node's alone (two nodes of one job on one host add no shared
  element, and one's end takes nothing from the other) and it binds the address to the
  interface a packet must come from or go to.
- **Routes** to the nodes on other hosts, through those hosts' addresses, in a routing table of
  this node's own (`ip rule from ITS-ADDRESS lookup TABLE`): nothing shared with another node,
  and its end flushes the table whole.

What a killed worker's node left is removed by the next node given the same veth name or
address (job_network.forget), before anything of its own is added.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from workers.launcher.job_network import (
    MESH_SETS,
    PEERS_IN,
    PEERS_OUT,
    RULE_PREF,
    TABLE,
    Attached,
    _run,
    forward_all,
    route_table,
)


@dataclass(frozen=True)
class Peer:
    """Another node of the same job: its veth's job address, and its worker host's address."""

    job_address: str
    host_address: str
    local: bool  # on this host: its /30 is connected here, no route needed


class Mesh:
    """`elements`: nftables is here, so the node's elements go in the sets (a routed worker's
    walls would drop it otherwise)."""

    def __init__(self, mine: Attached, peers: list[Peer], elements: bool = True) -> None:
        self.mine, self.peers, self.elements = mine, peers, elements
        self.table = str(route_table(mine))

    def open(self) -> None:
        remote = [p for p in self.peers if not p.local]
        if remote:
            if not self.mine.gateway:  # a routed host forwards already (job_network.prepare_host)
                forward_all()
            me = self.mine.job_address
            _run(["ip", "rule", "add", "from", f"{me}/32", "lookup", self.table, "pref", str(RULE_PREF)])
            routes = [
                f"route replace {p.job_address}/32 via {p.host_address} table {self.table}" for p in remote
            ]
            _run(["ip", "-batch", "-"], "\n".join(routes) + "\n")
        if self.peers and self.elements:
            _run(["nft", "-f", "-"], MESH_SETS + self._elements("add"))

    def close(self) -> None:
        if self.peers and self.elements:
            subprocess.run(["nft", "-f", "-"], input=self._elements("delete"), capture_output=True, text=True)
        subprocess.run(["ip", "route", "flush", "table", self.table], capture_output=True)
        subprocess.run(["ip", "rule", "del", "from", f"{self.mine.job_address}/32", "lookup", self.table],
                       capture_output=True)  # fmt: skip

    def _elements(self, verb: str) -> str:
        veth, me = f'"{self.mine.host_if}"', self.mine.job_address
        out = ", ".join(f"{veth} . {me} . {p.job_address}" for p in self.peers)
        into = ", ".join(f"{veth} . {p.job_address} . {me}" for p in self.peers)
        return (
            f"{verb} element inet {TABLE} {PEERS_OUT} {{ {out} }}\n"
            f"{verb} element inet {TABLE} {PEERS_IN} {{ {into} }}\n"
        )
