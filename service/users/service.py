from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.auth.tokens import hash_token, new_token
from service.errors import Conflict, NotFound
from service.models import User
from service.users.schemas import UserCreated


def create_user(session: Session, name: str) -> UserCreated:
    if session.execute(select(User.id).where(User.name == name)).scalar_one_or_none() is not None:
        raise Conflict(f"user {name!r} already exists")
    token = new_token()
    user = User(name=name, token_hash=hash_token(token), is_admin=False)
    session.add(user)
    session.flush()
    return UserCreated(id=user.id, name=user.name, token=token)


def rotate_token(session: Session, user_id: int, issue_new: bool) -> UserCreated | None:
    """Revoke a user's token (refused from the next request on) and optionally issue a new one."""
    user = session.get(User, user_id)
    if user is None or user.is_admin:
        raise NotFound("user")
    token = new_token() if issue_new else None
    user.token_hash = hash_token(token) if token else None
    session.flush()
    return UserCreated(id=user.id, name=user.name, token=token) if token else None
