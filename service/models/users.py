from __future__ import annotations

from datetime import datetime

from sqlalchemy import Boolean, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, UTCDateTime, utcnow


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    # SHA-256 of the bearer token; NULL once revoked. The token itself is never stored.
    token_hash: Mapped[str | None] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    # contract §9: the highest priority the user's jobs may ask for (the admin's: any), and
    # at most how many GPUs their jobs hold at once (None: no limit)
    max_priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    gpu_quota: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
