"""preemption, draining and elastic jobs (contract §12, v3): a job's `preemptible` and
`stop_grace_s`; the stop asked of a running job (`preempting_since`, and the job it makes room
for); the attempts that are not charged to `max_retries`; a worker being drained

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.models.base import UTCDateTime

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("preemptible", sa.Boolean(), server_default=sa.true(), nullable=False))
        batch.add_column(sa.Column("stop_grace_s", sa.Integer(), server_default="120", nullable=False))
        batch.add_column(sa.Column("preempting_since", UTCDateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("preempted_by", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("free_attempts", sa.Integer(), server_default="0", nullable=False))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("draining_since", UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("draining_since")
    with op.batch_alter_table("jobs") as batch:
        for column in ("free_attempts", "preempted_by", "preempting_since", "stop_grace_s", "preemptible"):
            batch.drop_column(column)
