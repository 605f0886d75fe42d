"""queued jobs counted per priority, and the hosts' data version (#42, `POST /v1/jobs`)

`queue_counts`: a new job's `queue_position` is a sum over a few rows of this table, not a
count over the queue (service/models/jobs.py `QueueCount`). Seeded from the jobs queued now,
all under "new"; from here on `service.jobs.states` keeps it in the transactions that move jobs.

`data_versions`: `hosts` is bumped whenever a host is registered or its GPU count or
accelerator changes, so that the API's copy of the cluster's capacity is checked in the very
statement that writes a job (service/models/workers.py `DataVersion`).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "queue_counts",
        sa.Column("priority", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("source", sa.String(length=8), nullable=False),
        sa.Column("jobs", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("priority", "source", name=op.f("pk_queue_counts")),
    )
    op.create_table(
        "data_versions",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_data_versions")),
    )
    op.execute(
        "INSERT INTO queue_counts (priority, source, jobs) "
        "SELECT priority, 'new', count(*) FROM jobs WHERE state = 'queued' GROUP BY priority"
    )
    op.execute("INSERT INTO data_versions (name, version) VALUES ('hosts', 0)")


def downgrade() -> None:
    op.drop_table("data_versions")
    op.drop_table("queue_counts")
