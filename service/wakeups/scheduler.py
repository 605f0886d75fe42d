"""Waking the scheduler when another process frees GPUs.

Jobs end on worker hosts: the worker's transaction frees the job's GPUs, and without a signal
the API's scheduler would notice only on its next timer tick (`scheduler_interval_s`). With
Redis as the broker every commit that freed GPUs publishes a wake-up carrying `"f"` (see
service/wakeups/publish.py); this thread subscribes to it and wakes the scheduler at once. A lost
message costs one timer tick, never a placement: the pass reads the database, as always.
The embedded setup has no Redis: there the same commit appends a byte to a file under
TORCHJOBS_HOME, and `FreedGpuFileWatcher` stats it every 50 ms (a stat, no query).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from service.wakeups.message import channel_for, freed_in

if TYPE_CHECKING:
    from redis.client import PubSub

log = logging.getLogger("torchjobs.scheduler")

MAX_BACKOFF_S = 5.0


class FreedGpuListener(threading.Thread):
    def __init__(self, redis_url: str, wake: Callable[[], None]) -> None:
        super().__init__(name="torchjobs-freed-gpus", daemon=True)
        self.url, self.wake = redis_url, wake
        self.subscribed = threading.Event()  # for tests and start-up ordering
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        import redis

        backoff = 0.5
        while not self._stopping.is_set():
            client = redis.Redis.from_url(self.url, socket_connect_timeout=3, health_check_interval=15)
            try:
                with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    pubsub.subscribe(channel_for(self.url))
                    self.subscribed.set()
                    self.wake()  # whatever was freed while not subscribed
                    backoff = 0.5
                    self._listen(pubsub)
            except (redis.RedisError, OSError) as exc:
                self.subscribed.clear()
                log.warning("freed-GPU wake-ups lost Redis (%s); timer only, retrying in %.1fs", exc, backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            finally:
                client.close()

    def _listen(self, pubsub: PubSub) -> None:
        while not self._stopping.is_set():
            msg = pubsub.get_message(timeout=1.0)
            if msg is not None and msg.get("type") == "message" and freed_in(msg["data"]):
                self.wake()


class FreedGpuFileWatcher(threading.Thread):
    def __init__(self, path: Path, wake: Callable[[], None], poll_s: float = 0.05) -> None:
        super().__init__(name="torchjobs-freed-gpus", daemon=True)
        self.path, self.wake, self.poll_s = path, wake, poll_s
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        last = self._stamp()
        while not self._stopping.wait(self.poll_s):
            stamp = self._stamp()
            if stamp != last:
                last = stamp
                self.wake()

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns
