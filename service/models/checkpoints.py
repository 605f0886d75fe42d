from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, UTCDateTime, utcnow


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    # No FK: jobs.resume_checkpoint_id already points this way, and a cycle breaks SQLite DDL.
    job_id: Mapped[int | None] = mapped_column(Integer, index=True)
    attempt: Mapped[int | None] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(255))
    epoch: Mapped[int | None] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    storage_key: Mapped[str] = mapped_column(String(512))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # contract §11: "file" (one object at storage_key) or "folder" (its files in
    # checkpoint_files; sha256 is the manifest's, size_bytes their sum, storage_key a prefix).
    kind: Mapped[str] = mapped_column(String(16), default="file", server_default="file")
    files: Mapped[int] = mapped_column(Integer, default=1, server_default="1")


class CheckpointFile(Base):
    """One file of a folder checkpoint (contract §11), from the node that stored it."""

    __tablename__ = "checkpoint_files"
    __table_args__ = (UniqueConstraint("checkpoint_id", "path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True)
    path: Mapped[str] = mapped_column(String(1024))  # relative, "/"-separated, inside the folder
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    node_rank: Mapped[int] = mapped_column(Integer)
    storage_key: Mapped[str] = mapped_column(String(1024))
