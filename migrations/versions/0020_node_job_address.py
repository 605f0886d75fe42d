"""a routed multi-node job's node address (contract §7 v3): where its peers route to and meet

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06 03:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node_runs") as batch:
        batch.add_column(sa.Column("job_address", sa.String(length=45), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node_runs") as batch:
        batch.drop_column("job_address")
