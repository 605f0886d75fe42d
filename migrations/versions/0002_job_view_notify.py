"""job view change notifications (PostgreSQL triggers for the API's job-view cache)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 23:00:00

Every table that `GET /v1/jobs/{id}` reads tells listeners which job changed, on commit:
`pg_notify('torchjobs_views', 'j<job id>')`, or `'u'` when a user changes (a rotated or
revoked token, a renamed owner). See service/jobs/view_feed.py. SQLite needs nothing: the
embedded setup uses `PRAGMA data_version`. New jobs notify nobody: a job that did not exist
cannot be cached.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JOB_CHANGED = """
CREATE OR REPLACE FUNCTION torchjobs_view_job_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('torchjobs_views', 'j' || OLD.id);
    RETURN NULL;
END $$
"""
CHILD_CHANGED = """
CREATE OR REPLACE FUNCTION torchjobs_view_child_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'DELETE' AND NEW.job_id IS NOT NULL THEN
        PERFORM pg_notify('torchjobs_views', 'j' || NEW.job_id);
    END IF;
    IF TG_OP <> 'INSERT' AND OLD.job_id IS NOT NULL THEN
        PERFORM pg_notify('torchjobs_views', 'j' || OLD.job_id);
    END IF;
    RETURN NULL;
END $$
"""
USER_CHANGED = """
CREATE OR REPLACE FUNCTION torchjobs_view_user_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('torchjobs_views', 'u');
    RETURN NULL;
END $$
"""
# (trigger, table, events, function); service/jobs/view_feed.py TRIGGERS lists the names.
CHILD = "INSERT OR UPDATE OR DELETE"
TRIGGERS = (
    ("torchjobs_view_jobs", "jobs", "UPDATE OR DELETE", "torchjobs_view_job_changed"),
    ("torchjobs_view_node_runs", "node_runs", CHILD, "torchjobs_view_child_changed"),
    ("torchjobs_view_job_attempts", "job_attempts", CHILD, "torchjobs_view_child_changed"),
    ("torchjobs_view_checkpoints", "checkpoints", CHILD, "torchjobs_view_child_changed"),
    ("torchjobs_view_users", "users", "UPDATE OR DELETE", "torchjobs_view_user_changed"),
)
FUNCTIONS = ("torchjobs_view_job_changed", "torchjobs_view_child_changed", "torchjobs_view_user_changed")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for body in (JOB_CHANGED, CHILD_CHANGED, USER_CHANGED):
        op.execute(body)
    for name, table, events, function in TRIGGERS:
        op.execute(
            f"CREATE TRIGGER {name} AFTER {events} ON {table} FOR EACH ROW EXECUTE FUNCTION {function}()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name, table, _events, _function in TRIGGERS:
        op.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
    for function in FUNCTIONS:
        op.execute(f"DROP FUNCTION IF EXISTS {function}()")
