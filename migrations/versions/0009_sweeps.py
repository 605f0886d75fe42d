"""sweeps (contract §10): a parent job and one child per point of a grid

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 14:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Columns and indexes only: on SQLite a new foreign key makes Alembic rebuild the `jobs` table,
# and a rebuild drops the old table, which the cascading keys of every table that points at
# `jobs` would follow (tests/service/test_migrations.py upgrades a populated database).


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("kind", sa.String(length=8), nullable=False, server_default="job"))
        batch.add_column(sa.Column("parent_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("sweep_point", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("sweep", sa.JSON(), nullable=True))
        batch.create_index("ix_jobs_parent_id_id", ["parent_id", "id"])
        batch.create_index("ix_jobs_kind_state", ["kind", "state"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_kind_state")
        batch.drop_index("ix_jobs_parent_id_id")
        batch.drop_column("sweep")
        batch.drop_column("sweep_point")
        batch.drop_column("parent_id")
        batch.drop_column("kind")
