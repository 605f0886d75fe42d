from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from service.api.deps import AdminDep, SessionDep, UserDep
from service.schemas import MAX_ID
from service.users import service
from service.users.schemas import UserCreate, UserCreated, UserOut

router = APIRouter(prefix="/v1", tags=["users"])


@router.post("/users", status_code=201, response_model=UserCreated)
def create_user(body: UserCreate, session: SessionDep, _admin: AdminDep) -> UserCreated:
    return service.create_user(session, body.name)


@router.get("/me", response_model=UserOut)
def me(user: UserDep) -> UserOut:
    return UserOut.model_validate(user)


@router.delete("/users/{user_id}/tokens", status_code=204)
def revoke_tokens(
    user_id: Annotated[int, Path(ge=1, le=MAX_ID)], session: SessionDep, _admin: AdminDep
) -> Response:
    service.rotate_token(session, user_id, issue_new=False)
    return Response(status_code=204)


@router.post("/users/{user_id}/tokens", status_code=201, response_model=UserCreated)
def issue_token(
    user_id: Annotated[int, Path(ge=1, le=MAX_ID)], session: SessionDep, _admin: AdminDep
) -> UserCreated:
    created = service.rotate_token(session, user_id, issue_new=True)
    assert created is not None
    return created
