"""The Celery app: it only delivers work. All state lives in the database.

What goes over the wire (the task's name and arguments, the queue naming, the broker options
and why acknowledgement is early) is `service.nodes.wire`; this builds the app from it, with
the embedded broker's transport (kombu's filesystem transport, made safe in broker_files.py).
"""

from __future__ import annotations

from celery import Celery

from service.config import Settings
from service.nodes import wire
from workers import broker_files


def make_celery(settings: Settings) -> Celery:
    broker = settings.resolved_broker_url
    if wire.is_embedded(settings):
        broker = broker_files.register()  # kombu's, with atomic writes (see broker_files.py)
        for sub in wire.EMBEDDED_FOLDERS:
            (settings.broker_folder / sub).mkdir(parents=True, exist_ok=True)
    app = Celery("torchjobs", broker=broker)
    app.conf.update(broker_transport_options=wire.transport_options(settings), **wire.CELERY_CONF)
    return app
