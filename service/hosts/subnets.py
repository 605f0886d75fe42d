"""Each worker host's job subnet (contract §7 v3), given by the control plane: a /24 of
`TORCHJOBS_JOB_SUBNET_POOL` per host address, the first free one, kept for good.

Why here: a multi-node job's nodes route to each other's job addresses across hosts
(workers/node_mesh.py), so no two hosts may hand out the same one, and the hosts know each
other only through the database. Workers on one host share its address and so its /24 (each
takes its /30s on the host by making the veth: the name is the lock). A host's
`TORCHJOBS_JOB_SUBNET`, where the admin sets one, is used instead and recorded
(`claim_subnet`), and no block over it is given to another host.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from sqlalchemy.exc import IntegrityError

from service.db import Database
from service.hosts import repository as repo

BLOCK_PREFIX = 24  # 64 job nodes at once per host (a /30 each), 256 hosts in a /16 pool


class NoSubnet(Exception):
    """The pool is not an IPv4 network of at least a /24, or every /24 of it is taken."""


def blocks(pool: str) -> list[str]:
    try:
        network = ipaddress.ip_network(pool)
    except ValueError as exc:
        raise NoSubnet(f"TORCHJOBS_JOB_SUBNET_POOL {pool!r} is not a network") from exc
    if network.version != 4 or network.prefixlen > BLOCK_PREFIX:
        raise NoSubnet(f"TORCHJOBS_JOB_SUBNET_POOL {pool!r}: an IPv4 network of at least a /{BLOCK_PREFIX}")
    return [str(block) for block in network.subnets(new_prefix=BLOCK_PREFIX)]


def subnet_of_host(
    db: Database, address: str, pool: str, tries: int | None = None, avoid: Sequence[str] = ()
) -> str:
    """The host's /24, given now if it has none. Hosts asking at once pick the same first free
    one: each loser's insert fails on the unique subnet and it picks again. Every such failure
    means another host took a block, so a whole pool's worth of tries (a hundred hosts
    rolled out at once) always ends. `avoid`: the host's own networks (its LAN): no block
    overlapping one is given (the host's traffic to those addresses would go to its jobs)."""
    candidates = [b for b in blocks(pool) if _clear_of(b, avoid)]
    if not candidates:
        raise NoSubnet(
            f"every /{BLOCK_PREFIX} of TORCHJOBS_JOB_SUBNET_POOL {pool} overlaps this host's networks "
            f"({', '.join(avoid)}): give a pool apart from them"
        )
    tries = len(candidates) + 5 if tries is None else tries
    for _ in range(tries):
        with db.transaction() as session:
            kept = repo.host_subnet(session, address)
            if kept is not None and kept in candidates:
                return kept
            if kept is not None:  # the pool changed, or the host's networks: its old block is out
                raise NoSubnet(
                    f"host {address} holds job subnet {kept}, outside TORCHJOBS_JOB_SUBNET_POOL {pool} "
                    f"or over this host's networks"
                )
        try:
            return _take_free(db, address, candidates)
        except IntegrityError:
            continue
    raise NoSubnet(f"no job subnet could be given to host {address} in {tries} tries")


def _clear_of(subnet: str, others: Iterable[str]) -> bool:
    """Whether `subnet` overlaps none of `others` (networks, as strings)."""
    network = ipaddress.ip_network(subnet)
    return not any(network.overlaps(ipaddress.ip_network(other)) for other in others)


def claim_subnet(db: Database, address: str, subnet: str) -> str | None:
    """An admin's `TORCHJOBS_JOB_SUBNET` for this host, recorded in place of whatever it held,
    so that the pool gives no other host a block over it. Where another host already holds
    one that overlaps it, nothing is recorded and what is wrong is returned, for the worker to
    say (the two hosts' meshes with each other will be refused: workers/node_mesh.py)."""
    network = ipaddress.ip_network(subnet)
    for _ in range(5):
        try:
            with db.transaction() as session:
                for other, held in repo.host_subnets(session):
                    if other != address and network.overlaps(ipaddress.ip_network(held)):
                        return f"TORCHJOBS_JOB_SUBNET {subnet} overlaps host {other}'s job subnet {held}"
                repo.set_host_subnet(session, address, str(network))
            return None
        except IntegrityError:  # another host took an overlapping block meanwhile: look again
            continue
    return f"TORCHJOBS_JOB_SUBNET {subnet} could not be recorded"


def _take_free(db: Database, address: str, candidates: list[str]) -> str:
    with db.transaction() as session:
        taken = repo.taken_subnets(session)
        free = next((block for block in candidates if _clear_of(block, taken)), None)
        if free is None:
            raise NoSubnet(f"every /{BLOCK_PREFIX} of the job subnet pool is taken ({len(taken)} hosts)")
        repo.add_host_subnet(session, address, free)
        return free
