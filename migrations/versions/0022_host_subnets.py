"""each worker host's job subnet (contract §7 v3): a /24 of the cluster's pool per host address

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07 17:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "host_subnets",
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("subnet", sa.String(length=45), nullable=False),
        sa.PrimaryKeyConstraint("address", name=op.f("pk_host_subnets")),
        sa.UniqueConstraint("subnet", name=op.f("uq_host_subnets_subnet")),
    )


def downgrade() -> None:
    op.drop_table("host_subnets")
