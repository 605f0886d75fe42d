from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Depends, Header, Query, Request, Response
from fastapi.security import HTTPAuthorizationCredentials
from starlette.concurrency import run_in_threadpool

from service.api.deps import (
    BlankIsAbsent,
    DbDep,
    JobDep,
    JobIdPath,
    PresentedCreds,
    SessionDep,
    SettingsDep,
    StorageDep,
    SubmitterDep,
    UserDep,
    current_user,
    int_or_blank,
)
from service.checkpoints.resume_check import check_resumable
from service.config import Settings
from service.db import Database
from service.jobs import metrics, service
from service.jobs.cached_reads import job_list_json, job_view_json
from service.jobs.dependencies import resumes_from_dependency
from service.jobs.schemas import EventList, JobList, JobOut, MetricsOut
from service.jobs.spec import JobSpec
from service.jobs.sweeps import expand_sweep
from service.jobs.validation import resume_target
from service.schemas import MAX_ID
from service.storage import Storage

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


async def wake_scheduler(request: Request) -> None:
    """A new job is placed now, not at the next timed pass, where a GPU is free (setting an
    event: no thread hop)."""
    scheduler = getattr(request.app.state, "scheduler", None)
    if scheduler is not None:
        scheduler.wake_for_submit()


async def resume_checked_spec(
    spec: JobSpec, db: DbDep, creds: PresentedCreds, settings: SettingsDep, storage: StorageDep
) -> JobSpec:
    """The spec, with the file it resumes from checked before the request's transaction begins:
    that check may load the file for seconds, and on SQLite that transaction holds the write
    lock. The handler resolves the checkpoint again under its lock; the verdict is remembered.
    A spec that resumes from nothing costs no thread-pool hop here."""
    specs = [child.spec for child in expand_sweep(spec)] if spec.sweep is not None else [spec]
    resuming = [one for one in specs if one.resume_from is not None and not resumes_from_dependency(one)]
    if resuming:
        await run_in_threadpool(_check_resumes, resuming, db, creds, settings, storage)
    return spec


def _check_resumes(
    specs: list[JobSpec],
    db: Database,
    creds: HTTPAuthorizationCredentials,
    settings: Settings,
    storage: Storage,
) -> None:
    seen: set[str] = set()
    for one in specs:  # a sweep's points may each resume from another file
        key = one.resume_from.model_dump_json() if one.resume_from is not None else ""
        if not key or key in seen:
            continue
        seen.add(key)
        with db.read() as session:
            target = resume_target(session, one, current_user(session, creds), lock=False)
        if target is not None:
            check_resumable(storage, settings, *target)


@router.post(
    "",
    status_code=201,
    response_model=JobOut,
    responses={200: {"model": JobOut, "description": "the job first created with this Idempotency-Key"}},
)
def submit_job(
    spec: Annotated[JobSpec, Depends(resume_checked_spec)],
    request: Request,
    background: BackgroundTasks,
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    submitter: SubmitterDep,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> Response:
    """The body is the `JobOut` serialised once, as `GET /v1/jobs/{id}` serves it (returned
    as a model, FastAPI would dump it, validate it again and encode the result)."""
    cache = request.app.state.submit_cache
    done = service.submit(session, settings, storage, submitter, cache, spec, idempotency_key)
    job = done.job
    if done.created:
        background.add_task(wake_scheduler, request)  # runs after the commit and the response
    positions = None if done.position is None else {job.id: done.position}
    view = service.job_views(session, [job], viewer=done.owner, created=done.created, positions=positions)[0]
    return Response(
        view.model_dump_json(),
        status_code=201 if done.created else 200,
        media_type="application/json",
        headers={"Location": f"/v1/jobs/{job.id}"},
    )


@router.get("", response_model=JobList)
async def list_jobs(
    request: Request,
    db: DbDep,
    creds: PresentedCreds,
    state: Annotated[str | None, Query(max_length=16), BlankIsAbsent] = None,
    limit: Annotated[int, Query(ge=1, le=500), BlankIsAbsent, int_or_blank(1, 500)] = 50,
    cursor: Annotated[str | None, Query(max_length=32), BlankIsAbsent] = None,
    parent: Annotated[
        int | None,
        Query(ge=1, le=MAX_ID, description="a sweep's id: its children"),
        BlankIsAbsent,
        int_or_blank(1, MAX_ID),
    ] = None,
    order: Annotated[
        str | None,
        Query(max_length=16, description='"objective": a sweep\'s children, best first (with parent)'),
        BlankIsAbsent,
    ] = None,
) -> Response:
    """Newest first, or with `order=objective` a sweep's children by the last value of its
    objective (contract §13). The page is assembled from the job-view cache's rendered jobs
    where it holds them, in one thread-pool hop (`service.jobs.cached_reads`)."""
    query = service.ListQuery(state=state, limit=limit, cursor=cursor, parent=parent, order=order)
    body = await job_list_json(db, request.app.state.view_cache, creds, query)
    return Response(body, media_type="application/json")


@router.get("/{job_id}", response_model=JobOut)
async def get_job(job_id: JobIdPath, request: Request, db: DbDep, creds: PresentedCreds) -> Response:
    """The busiest route (every client polls it): from the job-view cache, on the event loop,
    while a change feed keeps the cache current; otherwise one short read in one thread-pool
    hop (`service.jobs.cached_reads`). The body is a `JobOut` serialised once."""
    body = await job_view_json(db, request.app.state.view_cache, creds, job_id)
    return Response(body, media_type="application/json")


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut)
def cancel_job(job: JobDep, session: SessionDep, user: UserDep) -> JobOut:
    job = service.cancel_job(session, user, job.id)
    return service.job_views(session, [job], viewer=user)[0]


@router.get("/{job_id}/events", response_model=EventList)
def list_events(
    job: JobDep,
    session: SessionDep,
    user: UserDep,
    after: Annotated[int, Query(ge=0, le=MAX_ID), BlankIsAbsent, int_or_blank(0, MAX_ID)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000), BlankIsAbsent, int_or_blank(1, 10_000)] = 1000,
) -> EventList:
    return EventList(items=service.list_events(session, job, after, limit, viewer=user))


@router.get("/{job_id}/metrics", response_model=MetricsOut)
def job_metrics(
    job: JobDep,
    session: SessionDep,
    names: Annotated[
        str | None, Query(max_length=8192, description="comma-separated series names: only those")
    ] = None,
) -> Response:
    """Every series of the job (contract §13), or the named ones: the body is assembled from
    the stored points without a model round-trip (`service.jobs.metrics`)."""
    body = metrics.series_json(session, job.id, metrics.parse_names(names))
    return Response(body, media_type="application/json")
