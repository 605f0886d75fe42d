"""metric points as jsonb on PostgreSQL: `?names=` reads a few names without parsing each point

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05 16:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Rewrites the table (one pass over every stored point). SQLite keeps its JSON text."""
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "metric_points", "values", type_=postgresql.JSONB(), postgresql_using='"values"::jsonb'
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("metric_points", "values", type_=sa.JSON(), postgresql_using='"values"::json')
