"""users' own code (contract §6): uploaded archives, and a job's code and environment

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 04:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.models.base import UTCDateTime

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "code_archives",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("owner_id", sa.Integer(), sa.ForeignKey("users.id"), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("unpacked_bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("storage_key", sa.String(length=1024), nullable=False),
        sa.Column("created_at", UTCDateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("owner_id", "sha256"),
    )
    op.create_index("ix_code_archives_owner_id", "code_archives", ["owner_id"])
    op.create_index("ix_code_archives_sha256", "code_archives", ["sha256"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("code", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("environment", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("environment")
        batch.drop_column("code")
    op.drop_index("ix_code_archives_sha256", table_name="code_archives")
    op.drop_index("ix_code_archives_owner_id", table_name="code_archives")
    op.drop_table("code_archives")
