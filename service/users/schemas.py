from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

PRIORITY = Field(0, ge=-1000, le=1000, description="the highest priority the user's jobs may ask for")
QUOTA = Field(None, ge=0, le=1_000_000, description="at most this many GPUs in use at once (null: no limit)")


class UserCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$")
    max_priority: int = PRIORITY
    gpu_quota: int | None = QUOTA


class UserPatch(BaseModel):
    """Only the fields given change; `gpu_quota: null` lifts the quota."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_priority: int = PRIORITY
    gpu_quota: int | None = QUOTA


class UserOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    name: str
    is_admin: bool
    created_at: datetime
    max_priority: int = 0
    gpu_quota: int | None = None
    gpus_in_use: int = 0  # GPUs held by the user's jobs right now


class UserList(BaseModel):
    items: list[UserOut]


class UserCreated(BaseModel):
    id: int
    name: str
    token: str
