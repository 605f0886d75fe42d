"""a fair queue (contract §9): users' max_priority and gpu_quota; each attempt's GPUs and
GPU-seconds (old attempts filled in from their job and their times)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 10:00:00
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("users") as batch:
        batch.add_column(sa.Column("max_priority", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("gpu_quota", sa.Integer(), nullable=True))
    with op.batch_alter_table("job_attempts") as batch:
        batch.add_column(sa.Column("gpus", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("gpu_seconds", sa.Float(), server_default="0", nullable=False))
    _fill_in_old_attempts()


def _fill_in_old_attempts() -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "SELECT a.id, j.nodes * j.gpus_per_node AS gpus, a.started_at, a.finished_at "
            "FROM job_attempts a JOIN jobs j ON j.id = a.job_id"
        )
    ).all()
    for row in rows:
        seconds = 0.0
        if row.started_at is not None and row.finished_at is not None:
            seconds = max(0.0, (_aware(row.finished_at) - _aware(row.started_at)).total_seconds()) * row.gpus
        conn.execute(
            sa.text("UPDATE job_attempts SET gpus = :g, gpu_seconds = :s WHERE id = :i"),
            {"g": row.gpus, "s": seconds, "i": row.id},
        )


def _aware(value: datetime | str) -> datetime:
    """SQLite hands back text, PostgreSQL a datetime; both are UTC."""
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def downgrade() -> None:
    with op.batch_alter_table("job_attempts") as batch:
        batch.drop_column("gpu_seconds")
        batch.drop_column("gpus")
    with op.batch_alter_table("users") as batch:
        batch.drop_column("gpu_quota")
        batch.drop_column("max_priority")
