"""elastic jobs (contract §12, v3): a job's node range, and its resize in progress

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04 23:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.models.base import UTCDateTime

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


COLUMNS = (
    ("nodes_min", sa.Integer()),
    ("nodes_max", sa.Integer()),
    ("resize_reason", sa.String(length=16)),
    ("resize_wanted_at", UTCDateTime(timezone=True)),
    ("last_resize_at", UTCDateTime(timezone=True)),
)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
