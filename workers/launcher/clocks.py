"""A node's two clocks of contract §8: the job's time limit, and its silence.

The time limit counts from the claim (`NodeLimits.time_left_s` is what earlier attempts left).
Silence counts from the moment this node's ranks exist (not while the job waits, builds its
environment or meets its peers) and restarts at every report of any rank of any node: this
node's own output, seen here at once, and the others', seen through the job's
`last_report_at` in the database. A job is silent only when every node has heard nothing.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from service.nodes.values import NodeLimits

TIME_LIMIT = "time limit"
STALL = "stall"
LOST_PEERS = "lost peers"  # every other node ended, and this one still runs


class NodeClock:
    def __init__(self, limits: NodeLimits, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.limits = limits
        self.created = now
        self.deadline = None if limits.time_left_s is None else now + limits.time_left_s
        self.ranks_started: float | None = None
        self.heard_at: float | None = None  # this node's last output (monotonic)
        self.reported_at: datetime | None = None  # any node's, as stored
        self.peers_ended_at: datetime | None = None  # when the last other node ended, once all had

    @property
    def watches_silence(self) -> bool:
        return self.limits.stall_timeout_s is not None

    def ranks_up(self, now: float | None = None) -> None:
        if self.ranks_started is None:
            self.ranks_started = time.monotonic() if now is None else now

    def heard(self, now: float | None = None) -> None:
        self.heard_at = time.monotonic() if now is None else now

    def stored_report(self, at: datetime | None) -> None:
        if at is not None and (self.reported_at is None or at > self.reported_at):
            self.reported_at = at

    def peers_ended(self, at: datetime | None) -> None:
        self.peers_ended_at = at

    def alone_for(self, wall: datetime | None = None) -> float | None:
        if self.peers_ended_at is None:
            return None
        wall = datetime.now(UTC) if wall is None else wall
        return max(0.0, (wall - self.peers_ended_at).total_seconds())

    def silent_for(self, now: float | None = None, wall: datetime | None = None) -> float | None:
        """Seconds since the ranks started or anything was heard, whichever is later; None
        before the ranks exist."""
        if self.ranks_started is None:
            return None
        now = time.monotonic() if now is None else now
        quiet = now - max(self.ranks_started, self.heard_at or self.ranks_started)
        if self.reported_at is not None:
            wall = datetime.now(UTC) if wall is None else wall
            quiet = min(quiet, max(0.0, (wall - self.reported_at).total_seconds()))
        return quiet

    def verdict(self, now: float | None = None, wall: datetime | None = None) -> str | None:
        """TIME_LIMIT, STALL, LOST_PEERS, or None while the node may run on."""
        now = time.monotonic() if now is None else now
        if self.deadline is not None and now >= self.deadline:
            return TIME_LIMIT
        alone, patience = self.alone_for(wall), self.limits.peer_exit_timeout_s
        quiet_here = now - (self.heard_at or self.ranks_started or self.created)
        if alone is not None and patience is not None and alone >= patience and quiet_here >= patience:
            return LOST_PEERS  # alone, and silent: a rank still writing (a final eval) runs on
        timeout = self.limits.stall_timeout_s
        silent = self.silent_for(now, wall)
        if timeout is not None and silent is not None and silent >= timeout:
            return STALL
        return None
