"""The embedded broker: kombu's filesystem transport, without the race that killed the worker.

kombu writes a message in place (create the file, then write it), and a consumer that lists
the folder in between moves the still-empty file away and fails to parse it. That exception
leaves Celery's consumer as an "Unrecoverable error": the local worker of `torchjobs up`
stopped, went offline, and every job after it waited for ever (reproduced by dropping an empty
message file into the queue folder; the likely cause of two embedded DDP jobs that never
finished in one CI run, which left no logs to tell).

Here a message is written under a name no queue matches and renamed into place, which is
atomic on one filesystem, so a consumer sees all of it or none. A file that still cannot be
parsed, or is not shaped like a kombu message (truncated by a crash, a disk that filled up,
someone's stray file), is dropped with a warning instead of ending the consumer: the
scheduler sends again every node no worker has claimed (`service.scheduler.placement_pass.undelivered`),
so nothing is lost with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

log = logging.getLogger("torchjobs.worker")

SCHEME = "torchjobs-files"
STAGING_PREFIX = ".staging-"  # kombu matches "<stamp>_<uuid>.<queue>.msg"; this never does


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]  # kombu's two bases disagree on the name
        folder = self.data_folder_out
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        staging = os.path.join(folder, f"{STAGING_PREFIX}{uuid.uuid4()}")
        try:
            with open(staging, "wb") as fh:
                fh.write(str_to_bytes(dumps(payload)))
            os.replace(staging, os.path.join(folder, name))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        while True:  # kombu has removed the file before parsing it: a bad one is simply skipped
            try:
                payload = super()._get(queue)
            except ValueError as exc:
                log.warning("dropped an unreadable message on queue %s (%s)", queue, exc)
                continue
            if (
                isinstance(payload, dict)
                and "body" in payload
                and isinstance(payload.get("properties"), dict)
            ):
                return payload
            log.warning("dropped an unreadable message on queue %s (not a kombu message)", queue)


class Transport(filesystem.Transport):
    Channel = Channel


def register() -> str:
    """Make `torchjobs-files://` name this transport in this process; returns the URL."""
    TRANSPORT_ALIASES[SCHEME] = f"{__name__}:Transport"
    return f"{SCHEME}://"
