from __future__ import annotations

from fastapi import APIRouter, Response

from service.api.deps import AdminDep, SessionDep, UserDep, UserIdPath
from service.users import service
from service.users.schemas import UserCreate, UserCreated, UserList, UserOut, UserPatch

router = APIRouter(prefix="/v1", tags=["users"])


@router.post("/users", status_code=201, response_model=UserCreated)
def create_user(body: UserCreate, session: SessionDep, _admin: AdminDep) -> UserCreated:
    return service.create_user(session, body)


@router.get("/users", response_model=UserList)
def list_users(session: SessionDep, _admin: AdminDep) -> UserList:
    return service.list_users(session)


@router.patch("/users/{user_id}", response_model=UserOut)
def patch_user(user_id: UserIdPath, body: UserPatch, session: SessionDep, _admin: AdminDep) -> UserOut:
    """The admin changes a user's max_priority or gpu_quota (contract §9)."""
    return service.patch_user(session, user_id, body)


@router.get("/me", response_model=UserOut)
def me(user: UserDep, session: SessionDep) -> UserOut:
    return service.user_out(user, service.gpus_in_use(session))


@router.delete("/users/{user_id}/tokens", status_code=204)
def revoke_tokens(user_id: UserIdPath, session: SessionDep, _admin: AdminDep) -> Response:
    service.rotate_token(session, user_id, issue_new=False)
    return Response(status_code=204)


@router.post("/users/{user_id}/tokens", status_code=201, response_model=UserCreated)
def issue_token(user_id: UserIdPath, session: SessionDep, _admin: AdminDep) -> UserCreated:
    created = service.rotate_token(session, user_id, issue_new=True)
    assert created is not None
    return created
