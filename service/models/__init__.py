"""All tables; importing this module registers every model on `Base.metadata`."""

from service.models.base import Base, UTCDateTime, utcnow
from service.models.checkpoints import Checkpoint, CheckpointFile, CheckpointLook, CheckpointPart
from service.models.code import CodeArchive
from service.models.jobs import (
    GpuAllocation,
    Job,
    JobAttempt,
    JobDependency,
    JobEvent,
    LogChunk,
    NodeRun,
    QueueCount,
)
from service.models.metrics import MetricName, MetricPoint, SweepRung
from service.models.users import User
from service.models.webhooks import Webhook, WebhookAttempt, WebhookDelivery
from service.models.workers import DataVersion, HostSubnet, Worker

__all__ = [
    "Base",
    "Checkpoint",
    "CheckpointFile",
    "CheckpointLook",
    "CheckpointPart",
    "CodeArchive",
    "DataVersion",
    "GpuAllocation",
    "HostSubnet",
    "Job",
    "JobAttempt",
    "JobDependency",
    "JobEvent",
    "LogChunk",
    "MetricName",
    "MetricPoint",
    "NodeRun",
    "QueueCount",
    "SweepRung",
    "UTCDateTime",
    "User",
    "Webhook",
    "WebhookAttempt",
    "WebhookDelivery",
    "Worker",
    "utcnow",
]
