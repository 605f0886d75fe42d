"""into a running job: exec and forward sessions (contract §14, v3)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
