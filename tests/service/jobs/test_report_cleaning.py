"""The rank's own clock survives ingestion as `reported_at` (the event's `ts` is its storing time)."""

from __future__ import annotations

import math

from service.jobs.reports import _clean


def test_rank_timestamp_kept_as_reported_at() -> None:
    data = _clean({"type": "progress", "ts": 1700000000.25, "step": 1, "loss": math.nan})
    assert data == {"reported_at": 1700000000.25, "step": 1, "loss": None}


def test_a_timestamp_that_is_not_a_number_is_dropped() -> None:
    assert _clean({"type": "progress", "ts": "yesterday", "step": 2}) == {"step": 2}
    assert _clean({"ts": math.inf, "step": 3}) == {"step": 3}
    assert _clean({"ts": True, "step": 4}) == {"step": 4}
