from __future__ import annotations

from sqlalchemy.orm import Session

from service.auth.tokens import hash_token, new_token
from service.errors import Conflict, NotFound
from service.models import User
from service.usage.repository import gpus_in_use
from service.users import repository as repo
from service.users.schemas import UserCreate, UserCreated, UserList, UserOut, UserPatch


def create_user(session: Session, body: UserCreate) -> UserCreated:
    name = body.name
    if repo.name_taken(session, name):
        raise Conflict(f"user {name!r} already exists")
    token = new_token()
    user = User(
        name=name,
        token_hash=hash_token(token),
        is_admin=False,
        max_priority=body.max_priority,
        gpu_quota=body.gpu_quota,
    )
    repo.add(session, user)
    session.flush()
    return UserCreated(id=user.id, name=user.name, token=token)


def rotate_token(session: Session, user_id: int, issue_new: bool) -> UserCreated | None:
    """Revoke a user's token (refused from the next request on) and optionally issue a new one."""
    user = repo.get(session, user_id)
    if user is None or user.is_admin:
        raise NotFound("user")
    token = new_token() if issue_new else None
    user.token_hash = hash_token(token) if token else None
    session.flush()
    return UserCreated(id=user.id, name=user.name, token=token) if token else None


def user_out(user: User, in_use: dict[int, int]) -> UserOut:
    out = UserOut.model_validate(user)
    out.gpus_in_use = in_use.get(user.id, 0)
    return out


def list_users(session: Session) -> UserList:
    in_use = gpus_in_use(session)
    users = repo.all_users(session)
    return UserList(items=[user_out(u, in_use) for u in users])


def patch_user(session: Session, user_id: int, body: UserPatch) -> UserOut:
    """Changes apply from the scheduler's next pass; jobs already running keep their GPUs."""
    user = repo.lock(session, user_id)
    if user is None:
        raise NotFound("user")
    for field in body.model_fields_set:
        setattr(user, field, getattr(body, field))
    session.flush()
    return user_out(user, gpus_in_use(session))
