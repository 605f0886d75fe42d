"""Checkpoint routes: list a job's, read one, download (ranged, streamed), upload (validated).

The download and upload routes take no request session (see `service.checkpoints.service`):
their caller is authenticated, and the checkpoint looked up, in short reads of their own, so
nothing is held open while the bytes move.
"""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
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
from service.checkpoints import folder_files, folder_upload, recording, service, tar_stream
from service.checkpoints.schemas import CheckpointFileList, CheckpointList
from service.models import Checkpoint
from service.schemas import CheckpointOut, checkpoint_out, require_storable
from service.storage import Storage

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


@router.delete("/v1/checkpoints/{ckpt_id}", status_code=204, response_class=Response)
def delete_checkpoint(ckpt_id: CkptId, user: BriefUserDep, db: DbDep, storage: StorageDep) -> Response:
    """Contract §11: 204; 409 while a queued or running job will resume from it."""
    recording.delete_checkpoint(db, storage, user, ckpt_id)
    return Response(status_code=204)


@router.get(
    "/v1/checkpoints/{ckpt_id}/download",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, 206: {}, 304: {}, 416: {}},
)
async def download_checkpoint(
    request: Request,
    ckpt: Annotated[Checkpoint, Depends(caller_checkpoint_brief)],
    storage: StorageDep,
    db: DbDep,
    range_: Annotated[str | None, Header(alias="range", max_length=200)] = None,
    if_range: Annotated[str | None, Header(max_length=200)] = None,
    if_none_match: Annotated[str | None, Header(max_length=2000)] = None,
) -> Response:
    if folder_files.is_folder(ckpt):
        return await _download_folder(request, ckpt, storage, db, range_, if_range, if_none_match)
    try:
        plan = await service.plan_download(
            storage, ckpt, range_header=range_, if_range=if_range, if_none_match=if_none_match
        )
    except service.UnsatisfiableRange as exc:
        return _unsatisfiable(exc)
    return _ranged(request, plan, storage, ckpt.storage_key)


# HEAD answers the same headers without the body; kept out of the schema (one operation, one id).
router.add_api_route(
    "/v1/checkpoints/{ckpt_id}/download",
    download_checkpoint,
    methods=["HEAD"],
    response_class=StreamingResponse,
    include_in_schema=False,
)


async def _download_folder(
    request: Request,
    ckpt: Checkpoint,
    storage: StorageDep,
    db: DbDep,
    range_: str | None,
    if_range: str | None,
    if_none_match: str | None,
) -> Response:
    """A folder checkpoint's download: its deterministic tar (contract §11, `tar_stream`)."""
    served = await anyio.to_thread.run_sync(folder_files.load_files, db, ckpt)
    try:
        tar = folder_files.plan_tar(
            ckpt, served, range_header=range_, if_range=if_range, if_none_match=if_none_match
        )
    except service.UnsatisfiableRange as exc:
        return _unsatisfiable(exc)
    plan = tar.plan
    if plan.status == 304 or request.method == "HEAD":
        return Response(status_code=plan.status, headers=plan.headers, media_type="application/x-tar")
    return StreamingResponse(
        tar_stream.stream_range(storage, tar.root, tar.files, plan.start, plan.end),
        status_code=plan.status,
        headers=plan.headers,
        media_type="application/x-tar",
    )


def _ranged(request: Request, plan: service.DownloadPlan, storage: Storage, key: str) -> Response:
    """The planned bytes of one stored object: headers only for a 304 or a HEAD."""
    if plan.status == 304 or request.method == "HEAD":
        return Response(status_code=plan.status, headers=plan.headers, media_type="application/octet-stream")
    return StreamingResponse(
        service.read_range(storage, key, plan.start, plan.end),
        status_code=plan.status,
        headers=plan.headers,
        media_type="application/octet-stream",
    )


def _unsatisfiable(exc: service.UnsatisfiableRange) -> Response:
    return JSONResponse(
        {"detail": exc.detail}, status_code=416, headers={"Content-Range": f"bytes */{exc.size}"}
    )


@router.get("/v1/checkpoints/{ckpt_id}/files", response_model=CheckpointFileList)
def list_checkpoint_files(
    ckpt: Annotated[Checkpoint, Depends(caller_checkpoint)], session: SessionDep
) -> CheckpointFileList:
    """Every file of the checkpoint in manifest order; a file checkpoint lists itself."""
    return folder_files.list_files(session, ckpt)


@router.get(
    "/v1/checkpoints/{ckpt_id}/files/{path:path}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, 206: {}, 304: {}, 404: {}, 416: {}},
)
async def download_checkpoint_file(
    request: Request,
    path: str,
    ckpt: Annotated[Checkpoint, Depends(caller_checkpoint_brief)],
    storage: StorageDep,
    db: DbDep,
    range_: Annotated[str | None, Header(alias="range", max_length=200)] = None,
    if_range: Annotated[str | None, Header(max_length=200)] = None,
    if_none_match: Annotated[str | None, Header(max_length=2000)] = None,
) -> Response:
    """One file of a checkpoint by its path in the listing, with Range, ETag and checksum."""
    served = await anyio.to_thread.run_sync(folder_files.find_file, db, ckpt, path)
    try:
        plan = await folder_files.plan_file(
            storage, ckpt, served, range_header=range_, if_range=if_range, if_none_match=if_none_match
        )
    except service.UnsatisfiableRange as exc:
        return _unsatisfiable(exc)
    return _ranged(request, plan, storage, served.storage_key)


router.add_api_route(
    "/v1/checkpoints/{ckpt_id}/files/{path:path}",
    download_checkpoint_file,
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
    name: Annotated[str | None, Query(min_length=1, max_length=255), AfterValidator(require_storable)] = None,
) -> CheckpointOut | Response:
    """The raw body (`application/octet-stream`) is the file; `?name=` names it. A tar or gzip
    tar body (`application/x-tar`, `application/gzip`) is a folder checkpoint (contract §11)."""
    try:
        if folder_upload.is_folder_upload(request.headers.get("content-type")):
            ckpt = await folder_upload.create_folder_upload(
                db, storage, settings, user, name, request.stream()
            )
        else:
            ckpt = await service.create_upload(
                db, storage, settings, user, name or "upload.pt", request.stream()
            )
    except ClientDisconnect:
        return Response(status_code=400)  # nobody is left to read it; the partial file is gone
    return checkpoint_out(ckpt)
