"""The rank's own clock survives ingestion as `reported_at` (the event's `ts` is its storing time)."""

from __future__ import annotations

import math

from service.jobs.reports import _clean, with_fraction


def test_rank_timestamp_kept_as_reported_at() -> None:
    data = _clean({"type": "progress", "ts": 1700000000.25, "step": 1, "loss": math.nan})
    assert data == {"reported_at": 1700000000.25, "step": 1, "loss": None}


def test_a_timestamp_that_is_not_a_number_is_dropped() -> None:
    assert _clean({"type": "progress", "ts": "yesterday", "step": 2}) == {"step": 2}
    assert _clean({"ts": math.inf, "step": 3}) == {"step": 3}
    assert _clean({"ts": True, "step": 4}) == {"step": 4}


def test_a_progress_event_carries_the_contracts_fraction() -> None:
    """Contract §2: a `progress` event's data is the progress fields, `fraction` among them."""
    assert with_fraction({"step": 5, "total_steps": 20, "epoch": 0, "epochs": 4})["fraction"] == 0.25
    assert with_fraction({"epoch": 3, "epochs": 4})["fraction"] == 0.75  # a script's report
    assert with_fraction({"step": 30, "total_steps": 20})["fraction"] == 1.0
    assert with_fraction({"loss": 0.5}) == {"loss": 0.5, "fraction": None}
    assert with_fraction({"step": 1, "total_steps": 0})["fraction"] is None
    assert with_fraction({"step": True, "total_steps": 2})["fraction"] is None
    assert with_fraction({"fraction": 0.4, "step": 1, "total_steps": 2})["fraction"] == 0.4  # its own
