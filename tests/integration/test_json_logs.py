"""TORCHJOBS_LOG_JSON=1: every line the server and the worker write is one JSON object, and
the lines about a job carry its id."""

from __future__ import annotations

import json
from pathlib import Path

from service.testing import harness


def test_server_and_worker_log_json_with_job_ids(tmp_path: Path, pg_url: str, redis_url: str) -> None:
    stack = harness.production_stack(tmp_path, pg_url, redis_url, warm=False, TORCHJOBS_LOG_JSON="1")
    try:
        job = stack.submit({"mode": "single", "entrypoint": {"kind": "script", "path": "fail.py"}})
        assert stack.wait_job(job["id"])["state"] == "failed"
    finally:
        stack.stop()
    for key in ("server", "worker-w1"):
        lines = [line for line in stack.logs_of(key).splitlines() if line.strip()]
        assert lines, key
        records = [json.loads(line) for line in lines]  # raises if any line is not JSON
        assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    worker = [json.loads(line) for line in stack.logs_of("worker-w1").splitlines() if line.strip()]
    about_job = [r for r in worker if f"job {job['id']} " in r["msg"]]
    assert about_job and all(r.get("job_id") == job["id"] for r in about_job)
