"""Webhooks (contract §10): users register URLs; the events of their jobs are POSTed there.

Kept import-light: `service.jobs.states` calls `outbox.enqueue` for every event it writes.
"""
