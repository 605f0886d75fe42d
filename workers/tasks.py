"""Celery task definitions: thin wrappers that take ids and hand them to `workers.node`."""

from __future__ import annotations

from celery import Celery

from service.nodes.wire import RUN_NODE
from workers import context
from workers.node import run_node


def register_tasks(app: Celery) -> None:
    @app.task(name=RUN_NODE, acks_late=False, ignore_result=True)
    def run_node_task(job_id: int, attempt: int, node_rank: int) -> str:
        return run_node(context.current(), int(job_id), int(attempt), int(node_rank))
