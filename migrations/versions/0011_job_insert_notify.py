"""the job-view feed hears new jobs: `GET /v1/jobs` keeps its pages' ids until any job changes

Migration 0002's trigger on `jobs` fires on UPDATE and DELETE: a job view cannot be cached
before its job exists. A list page can: it must be dropped when a job is inserted elsewhere.
This adds an AFTER INSERT trigger that notifies `'j' || NEW.id` on the same channel
(service/jobs/view_feed.py lists it: without it the cache stays off).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 06:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JOB_INSERTED = """
CREATE OR REPLACE FUNCTION torchjobs_view_job_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('torchjobs_views', 'j' || NEW.id);
    RETURN NULL;
END $$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(JOB_INSERTED)
    op.execute(
        "CREATE TRIGGER torchjobs_view_jobs_insert AFTER INSERT ON jobs "
        "FOR EACH ROW EXECUTE FUNCTION torchjobs_view_job_inserted()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS torchjobs_view_jobs_insert ON jobs")
    op.execute("DROP FUNCTION IF EXISTS torchjobs_view_job_inserted()")
