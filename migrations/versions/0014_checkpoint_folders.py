"""checkpoints as frameworks write them: folders, files, node parts (contract §11, v3)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.models.base import UTCDateTime

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), server_default="file", nullable=False))
        batch.add_column(sa.Column("files", sa.Integer(), server_default="1", nullable=False))
    op.create_table(
        "checkpoint_files",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "checkpoint_id", sa.Integer(), sa.ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("storage_key", sa.String(1024), nullable=False),
        sa.UniqueConstraint("checkpoint_id", "path"),
    )
    op.create_index("ix_checkpoint_files_checkpoint_id", "checkpoint_files", ["checkpoint_id"])
    op.create_table(
        "checkpoint_parts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("prefix", sa.String(512), nullable=False),
        sa.Column("files", sa.JSON(), nullable=False),
        sa.Column("stored_at", UTCDateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_checkpoint_parts_job_attempt", "checkpoint_parts", ["job_id", "attempt"])
    op.create_table(
        "checkpoint_looks",
        sa.Column("job_id", sa.Integer(), primary_key=True),
        sa.Column("attempt", sa.Integer(), primary_key=True),
        sa.Column("node_rank", sa.Integer(), primary_key=True),
        sa.Column("looked_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("horizon", sa.Integer(), nullable=False),
        sa.Column("busy", sa.JSON(), nullable=False),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("keep_checkpoints", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("keep_checkpoints")
    op.drop_table("checkpoint_looks")
    op.drop_index("ix_checkpoint_parts_job_attempt", "checkpoint_parts")
    op.drop_table("checkpoint_parts")
    op.drop_index("ix_checkpoint_files_checkpoint_id", "checkpoint_files")
    op.drop_table("checkpoint_files")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("files")
        batch.drop_column("kind")
