"""All SQL about code archives."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import CodeArchive, User


def add(session: Session, row: CodeArchive) -> CodeArchive:
    """Add the row and flush: a duplicate (owner, sha256) raises IntegrityError here."""
    session.add(row)
    session.flush()
    return row


def owned(session: Session, owner_id: int, sha256: str) -> CodeArchive | None:
    query = select(CodeArchive).where(CodeArchive.owner_id == owner_id, CodeArchive.sha256 == sha256)
    return session.execute(query).scalar_one_or_none()


def any_with(session: Session, sha256: str) -> CodeArchive | None:
    query = select(CodeArchive).where(CodeArchive.sha256 == sha256).order_by(CodeArchive.id).limit(1)
    return session.execute(query).scalar_one_or_none()


def list_owned(session: Session, owner_id: int, limit: int = 1000) -> Sequence[CodeArchive]:
    query = (
        select(CodeArchive)
        .where(CodeArchive.owner_id == owner_id)
        .order_by(CodeArchive.created_at.desc(), CodeArchive.id.desc())
        .limit(limit)
    )
    return session.execute(query).scalars().all()


def owner_names(session: Session, owner_ids: set[int]) -> dict[int, str]:
    if not owner_ids:
        return {}
    rows = session.execute(select(User.id, User.name).where(User.id.in_(owner_ids))).all()
    return {row.id: row.name for row in rows}
