from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, String, UniqueConstraint
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


class CheckpointPart(Base):
    """One node's stored part of a folder checkpoint not yet listed (contract §11), or one being
    stored (`phase` "storing": its objects under `prefix` may be half there). A checkpoint is
    listed only once every node's part is "stored"; what is never listed is deleted, objects
    and all, when the nodes of its attempt have ended."""

    __tablename__ = "checkpoint_parts"
    __table_args__ = (Index("ix_checkpoint_parts_job_attempt", "job_id", "attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    node_rank: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(255))
    version: Mapped[int] = mapped_column(Integer, default=0)
    phase: Mapped[str] = mapped_column(String(16))  # "storing" | "stored" (no state machine of its own)
    prefix: Mapped[str] = mapped_column(String(512))  # every object of the part is under it
    files: Mapped[list[Any]] = mapped_column(JSON, default=list)  # [[path, size, sha256, key]...]
    stored_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class CheckpointLook(Base):
    """A node's last look at its checkpoint folder: the names there whose current form is not
    stored yet (`busy`). Node 0 lists a folder once every other node looked after its own part
    was stored and found that name stored or absent."""

    __tablename__ = "checkpoint_looks"

    job_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    looked_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    horizon: Mapped[int] = mapped_column(Integer, default=0)  # the newest part id before the look
    busy: Mapped[list[str]] = mapped_column(JSON, default=list)
