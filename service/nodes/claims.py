"""A node's claim and its end: the worker claims a node in the scheduler's own transactions
(a repeated or stale message finds nothing to claim) and records how it ended, with retries."""

from __future__ import annotations

from service.jobs.lifecycle import Claimed, claim_for_launch, record_end

__all__ = ["Claimed", "claim_for_launch", "record_end"]
