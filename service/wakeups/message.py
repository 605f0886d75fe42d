"""What a wake-up says ("job N has something new", never the data itself), and how a
transaction marks what it wrote so that the publisher (`publish.py`) sends it after the commit.

The database stays the source of truth: a lost, late or repeated wake-up can delay a stream or
a scheduling pass, never make it skip or repeat anything.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy.orm import Session

NOTIFY_EVENTS = "notify_jobs"  # `mark_events` fills it (called by `service.jobs.states.append_events`)
NOTIFY_LOGS = "notify_logs"
NOTIFY_FREED = "notify_freed"  # `service.jobs.states.free_gpus` sets it


def mark_events(session: Session, job_id: int) -> None:
    """Say that this transaction appended events for `job_id` (published after it commits)."""
    session.info.setdefault(NOTIFY_EVENTS, set()).add(job_id)


def mark_logs(session: Session, job_id: int) -> None:
    """Say that this transaction wrote log chunks for `job_id` (published after it commits)."""
    session.info.setdefault(NOTIFY_LOGS, set()).add(job_id)


def mark_freed(session: Session) -> None:
    """Say that this transaction gave GPUs back: the scheduler may place the next job."""
    session.info[NOTIFY_FREED] = True


def is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://"))


def channel_for(redis_url: str) -> str:
    """One channel per Redis database: Celery already requires every process to share it,
    and deployments that share a Redis server on different databases do not wake each other."""
    import redis

    db = redis.connection.parse_url(redis_url).get("db", 0) or 0
    return f"torchjobs:wakeups:{db}"


def encode(events: set[int], logs: set[int], freed: bool = False) -> str:
    msg: dict[str, Any] = {"e": sorted(events), "l": sorted(logs)}
    if freed:
        msg["f"] = 1
    return json.dumps(msg, separators=(",", ":"))


def decode(raw: bytes | str) -> tuple[list[int], list[int]]:
    try:
        msg = json.loads(raw)
        return [int(i) for i in msg.get("e", ())], [int(i) for i in msg.get("l", ())]
    except (ValueError, TypeError, AttributeError):
        return [], []


def freed_in(raw: bytes | str) -> bool:
    """Whether the committed transaction behind this wake-up freed GPUs."""
    try:
        return bool(json.loads(raw).get("f"))
    except (ValueError, TypeError, AttributeError):
        return False
