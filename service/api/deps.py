"""Request-scoped dependencies: the session (one transaction per request), the caller, and
the "get it, or 404 if it is not yours" lookup that every job route shares."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.auth.tokens import user_for_token
from service.config import Settings
from service.db import Database
from service.errors import Forbidden, Unauthorized
from service.jobs import service as jobs_service
from service.models import Job, User
from service.schemas import MAX_ID

bearer = HTTPBearer(auto_error=False, description="torchjobs bearer token")


def get_db(request: Request) -> Database:
    return request.app.state.db


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(db: Annotated[Database, Depends(get_db)]) -> Iterator[Session]:
    """Commits when the handler returns, rolls back when it raises; nothing else commits."""
    with db.sessionmaker() as session, session.begin():
        yield session


def current_user(
    session: Annotated[Session, Depends(get_session, scope="function")],
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> User:
    if creds is None or not creds.credentials or len(creds.credentials) > 512:
        raise Unauthorized()
    user = user_for_token(session, creds.credentials)
    if user is None:
        raise Unauthorized()
    return user


def admin_user(user: Annotated[User, Depends(current_user)]) -> User:
    if not user.is_admin:
        raise Forbidden("admin only")
    return user


def caller_job(
    session: Annotated[Session, Depends(get_session, scope="function")],
    user: Annotated[User, Depends(current_user)],
    job_id: Annotated[int, Path(ge=1, le=MAX_ID)],
) -> Job:
    return jobs_service.get_job(session, user, job_id)


# scope="function": the transaction commits when the handler returns, BEFORE the response is
# sent (FastAPI's default runs yield-dependency exits after it). A client that got its 201
# can read the job at once, and a commit that fails is a 5xx, never a 201 for nothing.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
UserDep = Annotated[User, Depends(current_user)]
AdminDep = Annotated[User, Depends(admin_user)]
JobDep = Annotated[Job, Depends(caller_job)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DbDep = Annotated[Database, Depends(get_db)]
