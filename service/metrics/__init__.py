"""Prometheus metrics: `GET /metrics` in the text exposition format.

Each app owns its own `CollectorRegistry` (never the process-global one), holding

- ``torchjobs_http_request_duration_seconds``: a histogram fed by `RequestLatencyMiddleware`,
  labelled by method, route template (``/v1/jobs/{job_id}``, never the raw path) and status;
- a collector that reads the database at scrape time: jobs by state, the queue wait of every
  attempt that started, the age of the oldest queued job, and GPUs used and free per worker.
"""
