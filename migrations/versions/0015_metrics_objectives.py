"""metric series, sweep objectives and early stopping (contract §13, v3)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
