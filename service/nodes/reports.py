"""What a running node writes and reads while it runs: batches of logs and progress (one
transaction each), node events, the job's control (state, attempt, last report), and when its
peers ended."""

from __future__ import annotations

from service.jobs.reports import job_control, node_event, peers_ended_at, write_batch

__all__ = ["job_control", "node_event", "peers_ended_at", "write_batch"]
