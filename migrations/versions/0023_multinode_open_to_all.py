"""workers.multinode_open_to_all and workers.meshes (contract §7 v3): a worker whose multi-node
jobs keep the host's network takes the admin's multi-node jobs only, and no job's nodes are
split between such a worker and one that gives them networks of their own

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07 22:55:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(
            sa.Column("multinode_open_to_all", sa.Boolean(), server_default=sa.true(), nullable=False)
        )
        batch.add_column(sa.Column("meshes", sa.Boolean(), server_default=sa.true(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("meshes")
        batch.drop_column("multinode_open_to_all")
