"""worker isolation (contract §7): how a worker walls ranks off, and whom it takes jobs from;
and the physical GPU behind each of its slots

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 01:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("isolation", sa.String(length=16), server_default="none", nullable=False))
        batch.add_column(
            sa.Column("isolation_detail", sa.String(length=512), server_default="", nullable=False)
        )
        batch.add_column(sa.Column("open_to_all", sa.Boolean(), server_default=sa.true(), nullable=False))
        batch.add_column(sa.Column("gpu_ids", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("gpu_ids")
        batch.drop_column("open_to_all")
        batch.drop_column("isolation_detail")
        batch.drop_column("isolation")
