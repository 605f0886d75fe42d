"""into a running job: exec and forward sessions (contract §14, v3): where each worker's exec
endpoint listens, and the secret the API proves itself with (only the database and that
worker process know it; see workers/exec_endpoint.py)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("exec_address", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("exec_secret", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("exec_secret")
        batch.drop_column("exec_address")
