"""metric series, sweep objectives and early stopping (contract §13, v3)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.models.base import UTCDateTime

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("objective", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("objective_value", sa.Float(), nullable=True))
        batch.add_column(sa.Column("objective_epoch", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("stop_intent", sa.String(16), nullable=True))
        batch.add_column(sa.Column("stopped_early", sa.JSON(), nullable=True))
    op.create_index("ix_jobs_parent_objective", "jobs", ["parent_id", "objective_value"])
    op.create_table(
        "metric_points",
        sa.Column("job_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=True),
        sa.Column("ts", UTCDateTime(timezone=True), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.Column("objective", sa.Float(), nullable=True),
    )
    op.create_table(
        "metric_names",
        sa.Column("job_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("name", sa.String(64), primary_key=True),
    )
    op.create_table(
        "sweep_rungs",
        sa.Column("parent_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("rung", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("child_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("recorded_at", UTCDateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("sweep_rungs")
    op.drop_table("metric_names")
    op.drop_table("metric_points")
    op.drop_index("ix_jobs_parent_objective", "jobs")
    with op.batch_alter_table("jobs") as batch:
        for column in ("stopped_early", "stop_intent", "objective_epoch", "objective_value", "objective"):
            batch.drop_column(column)
