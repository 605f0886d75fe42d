"""Each worker host's job subnet, given by the control plane (contract §7 v3): distinct hosts
never share one (a multi-node job's nodes route to each other's job addresses across hosts),
workers of one host share its own, and it is kept across restarts; a bad or full pool is said."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.db import Database
from service.hosts.subnets import NoSubnet, blocks, claim_subnet, subnet_of_host
from service.migrate import upgrade

POOL = "10.213.0.0/16"


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    settings = Settings(home=tmp_path)
    upgrade(settings)
    database = Database(settings)
    yield database
    database.dispose()


def test_hosts_get_distinct_subnets_and_keep_them(db: Database) -> None:
    a = subnet_of_host(db, "192.0.2.1", POOL)
    b = subnet_of_host(db, "192.0.2.2", POOL)
    assert (a, b) == ("10.213.0.0/24", "10.213.1.0/24")
    assert subnet_of_host(db, "192.0.2.1", POOL) == a  # a second worker of host a, or a restart


def test_hosts_asking_at_once_never_share_one(tmp_path: Path, pg_url: str) -> None:
    """PostgreSQL, eight hosts at once: the losers of a race on the same free /24 pick again."""
    settings = Settings(home=tmp_path, database_url=pg_url)
    upgrade(settings)
    database = Database(settings)
    got: dict[str, str] = {}
    barrier = threading.Barrier(8)

    def ask(address: str) -> None:
        barrier.wait()
        got[address] = subnet_of_host(database, address, POOL, tries=10)

    threads = [threading.Thread(target=ask, args=(f"192.0.2.{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    database.dispose()
    assert len(got) == 8 and len(set(got.values())) == 8, got


def test_a_bad_or_full_pool_is_said(db: Database) -> None:
    with pytest.raises(NoSubnet, match="at least a /24"):
        blocks("10.213.0.0/25")
    with pytest.raises(NoSubnet, match="not a network"):
        blocks("ten.two")
    small = "10.214.0.0/23"
    assert subnet_of_host(db, "192.0.2.1", small) == "10.214.0.0/24"
    assert subnet_of_host(db, "192.0.2.2", small) == "10.214.1.0/24"
    with pytest.raises(NoSubnet, match="taken"):
        subnet_of_host(db, "192.0.2.3", small)
    with pytest.raises(NoSubnet, match="outside TORCHJOBS_JOB_SUBNET_POOL"):
        subnet_of_host(db, "192.0.2.1", POOL)  # the pool changed under a host that holds one


def test_no_block_over_the_host_s_own_networks_is_given(db: Database) -> None:
    """A block over the host's LAN would send the host's own traffic to those addresses into
    its jobs: the first free block apart from them is given, or none, said."""
    lan = ["10.213.0.0/23", "192.0.2.0/24"]
    assert subnet_of_host(db, "192.0.2.1", POOL, avoid=lan) == "10.213.2.0/24"
    assert subnet_of_host(db, "192.0.2.2", POOL) == "10.213.0.0/24"  # another host's LAN differs
    with pytest.raises(NoSubnet, match="overlaps this host's networks"):
        subnet_of_host(db, "192.0.2.3", POOL, avoid=["10.0.0.0/8"])  # a flat 10/8 LAN: set a pool
    with pytest.raises(NoSubnet, match="over this host's networks"):  # its LAN grew over its block
        subnet_of_host(db, "192.0.2.2", POOL, avoid=["10.213.0.0/22"])


def test_an_admin_s_subnet_is_recorded_and_no_block_over_it_is_given(db: Database) -> None:
    """A host whose admin set TORCHJOBS_JOB_SUBNET: recorded in place of its pool block, the
    pool then gives no other host a block over it; another admin's overlapping one is said
    and not recorded (their meshes with each other would be refused)."""
    assert subnet_of_host(db, "192.0.2.1", POOL) == "10.213.0.0/24"
    assert claim_subnet(db, "192.0.2.1", "10.213.0.0/23") is None  # its admin's, over its block
    assert claim_subnet(db, "192.0.2.1", "10.213.0.0/23") is None  # again: a restart
    assert subnet_of_host(db, "192.0.2.2", POOL) == "10.213.2.0/24"  # not 10.213.1.0/24
    clash = claim_subnet(db, "192.0.2.3", "10.213.2.128/25")
    assert clash == "TORCHJOBS_JOB_SUBNET 10.213.2.128/25 overlaps host 192.0.2.2's job subnet 10.213.2.0/24"
    assert subnet_of_host(db, "192.0.2.3", POOL) == "10.213.3.0/24"  # nothing was recorded for it
