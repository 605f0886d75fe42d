"""quarantine (contract §8, v3): of a host's failures in a row, those its jobs' own code could
have caused, and whose jobs they were: one owner's alone no longer make a host sick

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("job_failures", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("job_failure_owners", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("job_failure_owners")
        batch.drop_column("job_failures")
