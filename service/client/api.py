"""The Python client: typed calls over httpx, the one thing the CLI talks through.

Idempotent calls (GET) retry on connection errors with tenacity; `submit` sends an
Idempotency-Key so that a retried submit can never create a second job.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import ssl
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from service.client.download import download_checkpoint
from service.client.errors import ApiError, read_json
from service.client.folder_pack import folder_files, packed_chunks, packed_size
from service.client.pack import pack_folder
from service.states import JobState

if TYPE_CHECKING:
    from service.client.exec_client import ExecResult

TERMINAL = tuple(str(s) for s in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED))
# Streams: reconnect on any transport failure, and count a connection silent for longer than
# a few of the server's keep-alive pings (15 s apart) as dropped.
STREAM_ERRORS = (httpx.TransportError,)
STREAM_RETRY_S = 1.0
STREAM_GIVE_UP_S = 60.0
STREAM_TIMEOUT = httpx.Timeout(10.0, read=60.0)
_retry_connect = retry(
    retry=retry_if_exception_type((httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)),
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=0.2, max=3),
    reraise=True,
)


def tls_for(url: str) -> ssl.SSLContext | bool:
    """httpx's own context (certifi's trust anchors) for an https API; for plain http, a
    context that trusts nothing. The client sends only to its base URL and follows no
    redirect, so over http that context is never used, and were it ever, it would fail closed.
    httpx builds its default context at once, whether used or not: 44 ms of CPU (certifi's
    bundle parsed) in every CLI command, against 0.4 ms for this one."""
    if url.strip().lower().startswith("https://"):
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class Client:
    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=timeout,
            transport=transport,
            verify=tls_for(url),
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @_retry_connect
    def _get(self, path: str, **params: Any) -> Any:
        return read_json(self.http.get(path, params={k: v for k, v in params.items() if v is not None}))

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        key = idempotency_key or uuid.uuid4().hex
        return self._submit(spec, key)

    @_retry_connect
    def _submit(self, spec: dict[str, Any], key: str) -> dict[str, Any]:
        return read_json(self.http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": key}))

    def get(self, job_id: int) -> dict[str, Any]:
        return self._get(f"/v1/jobs/{job_id}")

    def push_code(self, folder: str | Path, name: str | None = None) -> dict[str, Any]:
        """Pack a folder and upload it, unless the server already has these exact bytes."""
        packed = pack_folder(Path(folder))
        try:
            return self.get_code(packed.sha256)
        except ApiError as exc:
            if exc.status_code != 404:
                raise
        return self.upload_code(packed.data, name or Path(folder).resolve().name)

    def upload_code(self, data: bytes, name: str) -> dict[str, Any]:
        headers = {"Content-Type": "application/gzip"}
        return read_json(self.http.post("/v1/code", params={"name": name}, content=data, headers=headers))

    def get_code(self, code_id: str) -> dict[str, Any]:
        return self._get(f"/v1/code/{code_id}")

    def add_webhook(self, body: dict[str, Any]) -> dict[str, Any]:
        return read_json(self.http.post("/v1/webhooks", json=body))

    def list_webhooks(self) -> builtins.list[dict[str, Any]]:
        return self._get("/v1/webhooks")["items"]

    def delete_webhook(self, webhook_id: int) -> None:
        read_json(self.http.delete(f"/v1/webhooks/{webhook_id}"))

    def webhook_deliveries(self, webhook_id: int, limit: int = 20) -> builtins.list[dict[str, Any]]:
        return self._get(f"/v1/webhooks/{webhook_id}/deliveries", limit=limit)["items"]

    def list_code(self) -> builtins.list[dict[str, Any]]:
        return self._get("/v1/code")["items"]

    def list(
        self,
        state: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
        parent: int | None = None,
        order: str | None = None,
    ) -> dict[str, Any]:
        """`order="objective"` (with `parent`): a sweep's children, best first (contract §13)."""
        return self._get("/v1/jobs", state=state, limit=limit, cursor=cursor, parent=parent, order=order)

    def metrics(self, job_id: int, names: Iterable[str] | str | None = None) -> dict[str, Any]:
        """`{"names": [...], "series": [{"step","epoch","ts",name: value...}...]}`; `names`
        (a list or "a,b"): only those series."""
        wanted = names if names is None or isinstance(names, str) else ",".join(names)
        return dict(self._get(f"/v1/jobs/{job_id}/metrics", names=wanted or None))

    def events(self, job_id: int, after: int = 0) -> builtins.list[dict[str, Any]]:
        return self._get(f"/v1/jobs/{job_id}/events", after=after)["items"]

    def wait(self, job_id: int, timeout: float | None = None, poll_s: float = 1.0) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job["state"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']}")
            time.sleep(poll_s)

    def stream_events(self, job_id: int, after: int = 0) -> Iterator[dict[str, Any]]:
        """Every event after `after`, exactly once and in order, until the job's terminal state
        event. A dropped or silent connection is resumed with `Last-Event-ID`."""
        last, failures = after, 0
        path = f"/v1/jobs/{job_id}/events/stream"
        while True:
            try:
                with self._open_stream(path, {"Last-Event-ID": str(last)}) as resp:
                    failures = 0
                    for message in parse_sse(resp.iter_lines()):
                        event = json.loads(message.data)
                        if event["seq"] <= last:
                            continue
                        last = event["seq"]
                        yield event
                        if _is_terminal(event):
                            return
            except STREAM_ERRORS as exc:
                failures = _retry_wait(failures, exc)
                continue
            # Closed without the terminal event (a server restarting): finished, or resume.
            if self.get(job_id)["state"] in TERMINAL:
                for event in self.events(job_id, after=last):
                    yield event
                    if _is_terminal(event):
                        return
                return

    def stream_logs(
        self, job_id: int, node: int = 0, rank: int = 0, offset: int = 0, attempt: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """One rank's output as it is stored: `{"type": "log", "offset", "next_offset", "data"}`
        messages, then one `{"type": "end", "offset", "attempt", "state"}`. A dropped connection
        resumes at the next offset, on the same attempt."""
        pos, failures = offset, 0
        while True:
            params: dict[str, Any] = {"node": node, "rank": rank, "offset": pos}
            if attempt is not None:
                params["attempt"] = attempt
            try:
                with self._open_stream(
                    f"/v1/jobs/{job_id}/logs/stream", {"Last-Event-ID": str(pos)}, params
                ) as resp:
                    failures = 0
                    if attempt is None and resp.headers.get("X-Attempt", "").isdigit():
                        attempt = int(resp.headers["X-Attempt"])  # pinned: a retry must not splice in
                    for message in parse_sse(resp.iter_lines()):
                        body = json.loads(message.data)
                        if message.event == "end":
                            yield {"type": "end", **body}
                            return
                        if body["next_offset"] <= pos:
                            continue
                        pos = body["next_offset"]
                        yield {"type": "log", **body}
            except STREAM_ERRORS as exc:
                failures = _retry_wait(failures, exc)

    @contextlib.contextmanager
    def _open_stream(
        self, path: str, headers: dict[str, str], params: dict[str, Any] | None = None
    ) -> Iterator[httpx.Response]:
        with self.http.stream("GET", path, headers=headers, params=params, timeout=STREAM_TIMEOUT) as resp:
            if resp.status_code >= 500:
                raise httpx.RemoteProtocolError(f"server answered {resp.status_code}")
            if resp.status_code != 200:
                resp.read()
                read_json(resp)
            yield resp

    def logs(
        self, job_id: int, node: int = 0, rank: int = 0, offset: int = 0, attempt: int | None = None
    ) -> tuple[bytes, int]:
        data, nxt, _ = self.logs_page(job_id, node, rank, offset, attempt)
        return data, nxt

    def logs_page(
        self, job_id: int, node: int = 0, rank: int = 0, offset: int = 0, attempt: int | None = None
    ) -> tuple[bytes, int, int]:
        """(bytes from `offset`, the next offset, the attempt they belong to)."""
        resp = self._logs(job_id, node, rank, offset, attempt)
        return (
            resp.content,
            int(resp.headers.get("X-Next-Offset", offset)),
            int(resp.headers.get("X-Attempt", attempt or 0)),
        )

    @_retry_connect
    def _logs(self, job_id: int, node: int, rank: int, offset: int, attempt: int | None) -> httpx.Response:
        params = {"node": node, "rank": rank, "offset": offset}
        if attempt is not None:
            params["attempt"] = attempt
        resp = self.http.get(f"/v1/jobs/{job_id}/logs", params=params)
        if resp.status_code >= 400:
            read_json(resp)
        return resp

    def cancel(self, job_id: int) -> dict[str, Any]:
        return read_json(self.http.post(f"/v1/jobs/{job_id}/cancel"))

    def exec(
        self, job_id: int, cmd: str, *, node_rank: int = 0, local_rank: int = 0, stdin: bytes = b""
    ) -> ExecResult:
        """Contract §14: `cmd` inside that rank's sandbox; its output and exit code."""
        from service.client.exec_client import run_exec

        auth = self.http.headers.get("Authorization", "")
        return run_exec(
            str(self.http.base_url), auth.removeprefix("Bearer ") or None, job_id, cmd,
            node_rank=node_rank, local_rank=local_rank, stdin=stdin,
        )  # fmt: skip

    def users(self) -> builtins.list[dict[str, Any]]:
        return list(self._get("/v1/users")["items"])

    def add_user(self, name: str, **limits: Any) -> dict[str, Any]:
        return dict(read_json(self.http.post("/v1/users", json={"name": name, **limits})))

    def patch_user(self, user_id: int, **fields: Any) -> dict[str, Any]:
        return dict(read_json(self.http.patch(f"/v1/users/{user_id}", json=fields)))

    def revoke(self, user_id: int) -> None:
        resp = self.http.delete(f"/v1/users/{user_id}/tokens")
        if resp.status_code != 204:
            read_json(resp)

    def usage(self, **params: Any) -> dict[str, Any]:
        return dict(self._get("/v1/usage", **params))

    def workers(self) -> builtins.list[dict[str, Any]]:
        return list(self._get("/v1/workers")["items"])

    def readmit(self, worker: str) -> dict[str, Any]:
        return dict(read_json(self.http.post(f"/v1/workers/{quote(worker, safe='')}/readmit")))

    def drain(self, worker: str) -> dict[str, Any]:
        return dict(read_json(self.http.post(f"/v1/workers/{quote(worker, safe='')}/drain")))

    def checkpoints(self, job_id: int) -> builtins.list[dict[str, Any]]:
        return self._get(f"/v1/jobs/{job_id}/checkpoints")["items"]

    def checkpoint(self, ckpt_id: int) -> dict[str, Any]:
        return self._get(f"/v1/checkpoints/{ckpt_id}")

    def upload(self, path: str, name: str | None = None) -> dict[str, Any]:
        """A file checkpoint; or a folder (contract §11), sent as a tar of its regular files,
        named after the folder unless `name` is given."""
        if os.path.isdir(path):
            return self._upload_folder(path, name)

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as fh:
                while chunk := fh.read(1024 * 1024):
                    yield chunk

        return read_json(
            self.http.post(
                "/v1/checkpoints",
                params={"name": name or os.path.basename(path)},
                content=chunks(),
                headers={
                    "Content-Type": "application/octet-stream",
                    "Content-Length": str(os.path.getsize(path)),
                },
                timeout=None,
            )
        )

    def _upload_folder(self, path: str, name: str | None) -> dict[str, Any]:
        top = os.path.basename(os.path.abspath(path)) or "upload"
        files = folder_files(path)
        return read_json(
            self.http.post(
                "/v1/checkpoints",
                params={"name": name} if name else {},
                content=packed_chunks(top, files),
                headers={"Content-Type": "application/x-tar", "Content-Length": str(packed_size(top, files))},
                timeout=None,
            )
        )

    def checkpoint_files(self, ckpt_id: int) -> builtins.list[dict[str, Any]]:
        """A checkpoint's files (contract §11): path, size_bytes, sha256, node_rank."""
        return self._get(f"/v1/checkpoints/{ckpt_id}/files")["items"]

    def download(self, ckpt_id: int, dest: str, progress: Any = None) -> str:
        """A file checkpoint into the file `dest`; a folder checkpoint into `dest/NAME/…`, file
        by file. Resumes what an earlier call left, verifies every file (and a folder's
        manifest); returns the checkpoint's verified SHA-256."""
        return download_checkpoint(self.http, ckpt_id, self.checkpoint(ckpt_id), dest, progress)


@dataclass(frozen=True)
class SseMessage:
    event: str
    id: str | None
    data: str


def parse_sse(lines: Iterator[str]) -> Iterator[SseMessage]:
    """Server-Sent Events as the spec reads them; comments (`: ping`) are skipped."""
    data: list[str] = []
    event, event_id = "message", None
    for line in lines:
        if line == "":
            if data:
                yield SseMessage(event=event, id=event_id, data="\n".join(data))
            data, event, event_id = [], "message", None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id":
            event_id = value


def _retry_wait(failures: int, exc: Exception) -> int:
    """Wait before reconnecting a stream; re-raise once the server has been unreachable for
    about STREAM_GIVE_UP_S in a row."""
    if failures * STREAM_RETRY_S >= STREAM_GIVE_UP_S:
        raise exc
    time.sleep(STREAM_RETRY_S)
    return failures + 1


def _is_terminal(event: dict[str, Any]) -> bool:
    return event.get("type") == "state" and event.get("data", {}).get("state") in TERMINAL
