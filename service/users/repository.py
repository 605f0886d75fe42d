"""All SQL about users and their tokens."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Integer, Row, bindparam, exists, select
from sqlalchemy.orm import Session

from service.models import User

# Built once: every authenticated request runs it (see service/jobs/repository.py).
_USER_BY_TOKEN_HASH = select(User).where(User.token_hash == bindparam("token_hash"))


def by_token_hash(session: Session, token_hash: str) -> User | None:
    return session.execute(_USER_BY_TOKEN_HASH, {"token_hash": token_hash}).scalar_one_or_none()


# A write's guard (service.jobs.submit_cache): the caller's row still holds the token and every
# field that a process's copy of it was checked with. Bound as `caller_*` (`caller_guard_params`).
CALLER_UNCHANGED = exists().where(
    User.id == bindparam("caller_id", type_=Integer),
    User.token_hash == bindparam("caller_token_hash"),
    User.name == bindparam("caller_name"),
    User.is_admin == bindparam("caller_is_admin"),
    User.max_priority == bindparam("caller_max_priority", type_=Integer),
    User.gpu_quota.is_not_distinct_from(bindparam("caller_gpu_quota", type_=Integer)),
)


def by_name(session: Session, name: str) -> User | None:
    return session.execute(select(User).where(User.name == name)).scalar_one_or_none()


def name_taken(session: Session, name: str) -> bool:
    return session.execute(select(User.id).where(User.name == name)).scalar_one_or_none() is not None


def get(session: Session, user_id: int) -> User | None:
    """By primary key: the session's own copy when it holds one already (then no query)."""
    return session.get(User, user_id)


def lock(session: Session, user_id: int) -> User | None:
    """The user's row under a row lock (SQLite: the BEGIN IMMEDIATE lock already serialises)."""
    return session.get(User, user_id, with_for_update=True)


def add(session: Session, user: User) -> None:
    session.add(user)


def all_users(session: Session, name: str | None = None) -> Sequence[User]:
    """Every user in id order (only the one named `name`, when given)."""
    query = select(User).order_by(User.id)
    if name is not None:
        query = query.where(User.name == name)
    return session.execute(query).scalars().all()


def quotas(session: Session, user_ids: set[int]) -> Sequence[Row[int, str, int | None]]:
    """(id, name, gpu_quota) of these users."""
    return session.execute(select(User.id, User.name, User.gpu_quota).where(User.id.in_(user_ids))).all()
