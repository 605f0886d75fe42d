"""Checkpoint routes: list a job's, read one, download (ranged, streamed), upload (validated).

The download and upload routes take no request session (see `service.checkpoints.service`):
their caller is authenticated, and the checkpoint looked up, in short reads of their own, so
nothing is held open while the bytes move.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator
from starlette.requests import ClientDisconnect

from service.api.deps import (
    BriefUserDep,
    CheckpointIdPath,
    DbDep,
    JobDep,
    PresentedCreds,
    SessionDep,
    SettingsDep,
    StorageDep,
    UserDep,
    current_user,
)
from service.checkpoints import service
from service.checkpoints.schemas import CheckpointList
from service.models import Checkpoint
from service.schemas import CheckpointOut, checkpoint_out, require_storable

router = APIRouter(tags=["checkpoints"])
CkptId = CheckpointIdPath


def caller_checkpoint(session: SessionDep, user: UserDep, ckpt_id: CkptId) -> Checkpoint:
    return service.get_checkpoint(session, user, ckpt_id)


def caller_checkpoint_brief(db: DbDep, creds: PresentedCreds, ckpt_id: CkptId) -> Checkpoint:
    """`caller_checkpoint` in a short read of its own: a request-scoped session would stay open
    (on SQLite, holding the write lock) for as long as the download."""
    with db.read() as session:
        return service.get_checkpoint(session, current_user(session, creds), ckpt_id)


@router.get("/v1/jobs/{job_id}/checkpoints", response_model=CheckpointList)
def list_job_checkpoints(job: JobDep, session: SessionDep) -> CheckpointList:
    return CheckpointList(items=service.list_checkpoints(session, job))


@router.get("/v1/checkpoints/{ckpt_id}", response_model=CheckpointOut)
def get_checkpoint(ckpt: Annotated[Checkpoint, Depends(caller_checkpoint)]) -> CheckpointOut:
    return checkpoint_out(ckpt)


@router.get(
    "/v1/checkpoints/{ckpt_id}/download",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, 206: {}, 304: {}, 416: {}},
)
async def download_checkpoint(
    request: Request,
    ckpt: Annotated[Checkpoint, Depends(caller_checkpoint_brief)],
    storage: StorageDep,
    range_: Annotated[str | None, Header(alias="range", max_length=200)] = None,
    if_range: Annotated[str | None, Header(max_length=200)] = None,
    if_none_match: Annotated[str | None, Header(max_length=2000)] = None,
) -> Response:
    try:
        plan = await service.plan_download(
            storage, ckpt, range_header=range_, if_range=if_range, if_none_match=if_none_match
        )
    except service.UnsatisfiableRange as exc:
        return JSONResponse(
            {"detail": exc.detail}, status_code=416, headers={"Content-Range": f"bytes */{exc.size}"}
        )
    if plan.status == 304 or request.method == "HEAD":
        return Response(status_code=plan.status, headers=plan.headers, media_type="application/octet-stream")
    return StreamingResponse(
        service.read_range(storage, ckpt.storage_key, plan.start, plan.end),
        status_code=plan.status,
        headers=plan.headers,
        media_type="application/octet-stream",
    )


# HEAD answers the same headers without the body; kept out of the schema (one operation, one id).
router.add_api_route(
    "/v1/checkpoints/{ckpt_id}/download",
    download_checkpoint,
    methods=["HEAD"],
    response_class=StreamingResponse,
    include_in_schema=False,
)


@router.post("/v1/checkpoints", status_code=201, response_model=CheckpointOut)
async def upload_checkpoint(
    request: Request,
    user: BriefUserDep,
    db: DbDep,
    storage: StorageDep,
    settings: SettingsDep,
    name: Annotated[str, Query(min_length=1, max_length=255), AfterValidator(require_storable)] = "upload.pt",
) -> CheckpointOut | Response:
    """The raw body (`application/octet-stream`) is the file; `?name=` names it."""
    try:
        ckpt = await service.create_upload(db, storage, settings, user, name, request.stream())
    except ClientDisconnect:
        return Response(status_code=400)  # nobody is left to read it; the partial file is gone
    return checkpoint_out(ckpt)
