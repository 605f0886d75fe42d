"""A worker host's registration and liveness, through the worker-host gate
(`service.hosts.states`): announce it online, heartbeat, mark it offline on shutdown."""

from __future__ import annotations

from service.hosts.states import heartbeat, mark_offline, upsert_worker

__all__ = ["heartbeat", "mark_offline", "upsert_worker"]
