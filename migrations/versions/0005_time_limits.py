"""time limits and stalls (contract §8): a job's max_duration_s and stall_timeout_s, and when
its ranks last reported

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 08:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.models.base import UTCDateTime

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("max_duration_s", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("stall_timeout_s", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("last_report_at", UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("last_report_at")
        batch.drop_column("stall_timeout_s")
        batch.drop_column("max_duration_s")
