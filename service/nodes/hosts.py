"""A worker host's registration and liveness, through the worker-host gate
(`service.hosts.states`): announce it online, heartbeat, mark it offline on shutdown; and its
job subnet (`service.hosts.subnets`)."""

from __future__ import annotations

from service.hosts.states import heartbeat, mark_offline, upsert_worker
from service.hosts.subnets import NoSubnet, claim_subnet, subnet_of_host

__all__ = ["NoSubnet", "claim_subnet", "heartbeat", "mark_offline", "subnet_of_host", "upsert_worker"]
