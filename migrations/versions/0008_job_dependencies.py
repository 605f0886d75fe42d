"""job dependencies (contract §10): a job waits for other jobs to succeed or to end

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 11:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_dependencies",
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column(
            "depends_on_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("condition", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "depends_on_id"),
    )
    op.create_index("ix_job_dependencies_depends_on_id", "job_dependencies", ["depends_on_id"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("depends_on", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("depends_on")
    op.drop_index("ix_job_dependencies_depends_on_id", table_name="job_dependencies")
    op.drop_table("job_dependencies")
