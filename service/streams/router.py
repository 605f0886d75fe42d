"""Live status over HTTP: a job's events as Server-Sent Events, one rank's log by byte offset
and as Server-Sent Events. See docs/streams.md for the wire formats."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import PlainTextResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from service.api.deps import (
    BlankIsAbsent,
    DbDep,
    JobDep,
    JobIdPath,
    PresentedCreds,
    SessionDep,
    SettingsDep,
    caller_job,
    current_user,
    int_or_blank,
)
from service.auth.tokens import presented_token, user_for_token
from service.models import Job
from service.schemas import MAX_ID
from service.streams import service
from service.streams.service import CallerCheck, LogEnd, Streams

router = APIRouter(tags=["streams"])

Position = Annotated[int, Query(ge=0, le=2**62), BlankIsAbsent, int_or_blank(0, 2**62)]
Seq = Annotated[int, Query(ge=0, le=MAX_ID), BlankIsAbsent, int_or_blank(0, MAX_ID)]
Node = Annotated[
    int, Query(ge=0, le=100_000, description="node rank"), BlankIsAbsent, int_or_blank(0, 100_000)
]
Rank = Annotated[
    int,
    Query(ge=0, le=100_000, description="local rank on that node"),
    BlankIsAbsent,
    int_or_blank(0, 100_000),
]
Attempt = Annotated[
    int | None,
    Query(ge=1, le=1_000_000, description="default (or empty): the latest"),
    BlankIsAbsent,
    int_or_blank(1, 1_000_000),
]
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", max_length=64)]
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stream_job(
    db: DbDep,
    creds: PresentedCreds,
    job_id: JobIdPath,
) -> Job:
    """`caller_job` in a read of its own that ends before the stream starts: a request-scoped
    session would stay open (on SQLite, holding the write lock) for as long as the stream."""
    with db.read() as session:
        return caller_job(session, current_user(session, creds), job_id)


StreamJob = Annotated[Job, Depends(stream_job)]


def _sse(
    request: Request, messages: AsyncIterator[ServerSentEvent], headers: dict[str, str] | None = None
) -> EventSourceResponse:
    return EventSourceResponse(
        messages,
        ping=request.app.state.settings.sse_ping_s,
        ping_message_factory=lambda: ServerSentEvent(comment="ping"),
        headers={**STREAM_HEADERS, **(headers or {})},
    )


SSE_MESSAGE = {
    "type": "object",
    "description": "one SSE message: `id`, `event` (the type) and `data` (JSON)",
    "properties": {"id": {"type": "string"}, "event": {"type": "string"}, "data": {"type": "string"}},
}
SSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": SSE_MESSAGE}}, "description": "Server-Sent Events"}
}
TEXT: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "log bytes"}
}


@router.get("/v1/jobs/{job_id}/events/stream", response_class=EventSourceResponse, responses=SSE)
async def stream_events(
    request: Request,
    job: StreamJob,
    creds: PresentedCreds,
    after: Seq = 0,
    last_event_id: LastEventId = None,
) -> EventSourceResponse:
    """`id: SEQ`, `event: TYPE`, `data: EVENT_JSON`; resumes after the larger of `?after=` and
    `Last-Event-ID`; ends after the terminal state event."""
    start = service.start_position(after, last_event_id, cap=MAX_ID)
    streams: Streams = request.app.state.streams
    allowed = CallerCheck(streams, presented_token(creds), user_for_token)

    async def messages() -> AsyncIterator[ServerSentEvent]:
        async for item in service.event_stream(streams, job.id, start, allowed):
            yield ServerSentEvent(data=item.json, event=item.type, id=str(item.seq))

    return _sse(request, messages())


@router.get("/v1/jobs/{job_id}/logs", response_class=PlainTextResponse, responses=TEXT)
def get_logs(
    job: JobDep,
    session: SessionDep,
    settings: SettingsDep,
    node: Node = 0,
    rank: Rank = 0,
    offset: Position = 0,
    attempt: Attempt = None,
) -> Response:
    """Up to `logs_page_bytes` of the rank's combined stdout and stderr from byte `offset`."""
    page = service.read_logs(session, settings, job, node=node, rank=rank, offset=offset, attempt=attempt)
    return Response(
        page.data,
        media_type="text/plain; charset=utf-8",
        headers={"X-Next-Offset": str(page.next_offset), "X-Attempt": str(page.attempt)},
    )


@router.get("/v1/jobs/{job_id}/logs/stream", response_class=EventSourceResponse, responses=SSE)
async def stream_logs(
    request: Request,
    job: StreamJob,
    creds: PresentedCreds,
    node: Node = 0,
    rank: Rank = 0,
    offset: Position = 0,
    attempt: Attempt = None,
    last_event_id: LastEventId = None,
) -> EventSourceResponse:
    """`event: log` messages with `id:` the next offset and `data: {"offset","next_offset","data"}`,
    then one `event: end` `data: {"offset","attempt","state"}` once the rank's attempt is over."""
    attempt_no = service.check_log_position(job, node, attempt)
    start = service.start_position(offset, last_event_id)
    streams: Streams = request.app.state.streams
    allowed = CallerCheck(streams, presented_token(creds), user_for_token)

    async def messages() -> AsyncIterator[ServerSentEvent]:
        async for piece in service.log_stream(
            streams, job.id, attempt=attempt_no, node=node, rank=rank, offset=start, allowed=allowed
        ):
            if isinstance(piece, LogEnd):
                end = {"offset": piece.offset, "attempt": piece.attempt, "state": piece.state}
                yield ServerSentEvent(data=_json(end), event="end")
            else:
                body = {"offset": piece.offset, "next_offset": piece.next_offset, "data": piece.text}
                yield ServerSentEvent(data=_json(body), event="log", id=str(piece.next_offset))

    return _sse(request, messages(), {"X-Attempt": str(attempt_no)})


def _json(obj: object) -> str:
    return service.compact_json(obj)
