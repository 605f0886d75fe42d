"""The Celery wire between the scheduler and the workers: it only delivers work.

Both ends build their Celery app from this (`workers.celery_app.make_celery`): the task's name
and arguments, the queue naming (each worker consumes only its own queue, so the scheduler's
placement decides which host runs which node), and the broker options.

Hour-long tasks and brokers that restart: we acknowledge a message as soon as a worker takes
it (prefetch of one), and do not depend on late acknowledgement or on the visibility timeout.
The node row in the database is the truth: a re-delivered or duplicated message finds its
node already claimed and does nothing, and a message lost before its node was claimed (a
worker that died on receipt, a broker restart) is sent again by the scheduler
(`service.scheduler.placement_pass.undelivered`). Late acknowledgement was tried and dropped: with it a
running node holds an unacked message for hours, and kombu's Redis transport crashed the
consumer ("Unrecoverable error") while restoring that message after a Redis restart.
The embedded broker is kombu's filesystem transport (made safe in `workers/broker_files.py`):
a folder under TORCHJOBS_HOME, no server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.config import Settings

if TYPE_CHECKING:
    from celery import Celery

RUN_NODE = "torchjobs.run_node"  # its arguments: (job_id, attempt, node_rank)
EMBEDDED_POLL_S = 0.05
EMBEDDED_FOLDERS = ("queue", "processed")  # made before the app starts, under the broker folder

# The app's settings, the same at both ends.
CELERY_CONF: dict[str, object] = {
    "broker_connection_retry_on_startup": True,
    "task_acks_late": False,
    "task_reject_on_worker_lost": False,
    "worker_prefetch_multiplier": 1,
    "task_ignore_result": True,
    "result_backend": None,
    "task_serializer": "json",
    "accept_content": ["json"],
    "worker_hijack_root_logger": False,
    "worker_send_task_events": False,
    "broker_heartbeat": 0,
    "worker_enable_remote_control": False,  # cancels go through the database, not pidbox
}


def queue_for(worker_name: str) -> str:
    return f"worker.{worker_name}"


def is_embedded(settings: Settings) -> bool:
    return settings.resolved_broker_url.startswith("filesystem")


def transport_options(settings: Settings) -> dict[str, object]:
    """`broker_transport_options`: the embedded broker's folders, or a week's visibility."""
    if not is_embedded(settings):
        return {"visibility_timeout": 7 * 24 * 3600}
    folder = settings.broker_folder
    return {
        "data_folder_in": str(folder / "queue"),
        "data_folder_out": str(folder / "queue"),
        "processed_folder": str(folder / "processed"),
        "control_folder": str(folder / "control"),
        "store_processed": False,
        # kombu looks at the folder once a second by default: up to a second between a
        # job's placement and its launch. A listdir of a near-empty folder costs microseconds.
        "polling_interval": EMBEDDED_POLL_S,
    }


def send_node(app: Celery, *, job_id: int, attempt: int, node_rank: int, worker: str) -> None:
    app.send_task(RUN_NODE, args=[job_id, attempt, node_rank], queue=queue_for(worker))
