"""quarantine (contract §8): a host's infrastructure failures in a row, and why it takes no work

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("infra_failures", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("quarantine_reason", sa.String(length=512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("quarantine_reason")
        batch.drop_column("infra_failures")
