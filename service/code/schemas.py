from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class CodeOut(BaseModel):
    id: str  # the hex SHA-256 of the uploaded bytes
    name: str
    owner: str
    size_bytes: int
    unpacked_bytes: int
    files: int
    created_at: datetime


class CodeList(BaseModel):
    items: list[CodeOut]
