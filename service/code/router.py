"""Code routes (contract §6): upload an archive, read one, list the caller's."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import AfterValidator
from starlette.requests import ClientDisconnect

from service.api.deps import BriefUserDep, DbDep, SessionDep, SettingsDep, StorageDep, UserDep
from service.code import service
from service.code.schemas import CodeList, CodeOut
from service.errors import NotFound
from service.schemas import require_storable

router = APIRouter(prefix="/v1", tags=["code"])
SHA256 = re.compile(r"[0-9a-f]{64}")


@router.post("/code", status_code=201, response_model=CodeOut)
async def upload_code(
    request: Request,
    user: BriefUserDep,
    db: DbDep,
    storage: StorageDep,
    settings: SettingsDep,
    name: Annotated[str | None, Query(max_length=255), AfterValidator(require_storable)] = None,
) -> CodeOut | Response:
    """The raw body (`application/gzip`) is a `.tar.gz` of a folder; `?name=` names it."""
    try:
        code, created = await service.upload_code(
            db, storage, settings, user, service.default_name(name), request.stream()
        )
    except ClientDisconnect:
        return Response(status_code=400)  # nobody is left to read it; the partial file is gone
    if created:
        return code
    return JSONResponse(code.model_dump(mode="json"), status_code=200)


@router.get("/code", response_model=CodeList)
def list_code(session: SessionDep, user: UserDep) -> CodeList:
    return service.list_code(session, user)


@router.get("/code/{code_id}", response_model=CodeOut)
def get_code(code_id: Annotated[str, Path(max_length=200)], session: SessionDep, user: UserDep) -> CodeOut:
    if not SHA256.fullmatch(code_id):
        raise NotFound("code")  # no such code, whatever the id looks like
    return service.get_code(session, user, code_id)
