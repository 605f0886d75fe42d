"""The Python client: typed calls over httpx, the one thing the CLI talks through.

Idempotent calls (GET) retry on connection errors with tenacity; `submit` sends an
Idempotency-Key so that a retried submit can never create a second job.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

TERMINAL = ("succeeded", "failed", "cancelled")
_retry_connect = retry(
    retry=retry_if_exception_type((httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)),
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=0.2, max=3),
    reraise=True,
)


class ApiError(Exception):
    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code, self.detail = status_code, detail


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
            base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @_retry_connect
    def _get(self, path: str, **params: Any) -> Any:
        return _json(self.http.get(path, params={k: v for k, v in params.items() if v is not None}))

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        key = idempotency_key or uuid.uuid4().hex
        return self._submit(spec, key)

    @_retry_connect
    def _submit(self, spec: dict[str, Any], key: str) -> dict[str, Any]:
        return _json(self.http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": key}))

    def get(self, job_id: int) -> dict[str, Any]:
        return self._get(f"/v1/jobs/{job_id}")

    def list(self, state: str | None = None, limit: int = 50, cursor: str | None = None) -> dict[str, Any]:
        return self._get("/v1/jobs", state=state, limit=limit, cursor=cursor)

    def events(self, job_id: int, after: int = 0) -> list[dict[str, Any]]:
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
        """Every event after `after`, exactly once, reconnecting with Last-Event-ID on drops."""
        last = after
        while True:
            try:
                with self.http.stream(
                    "GET",
                    f"/v1/jobs/{job_id}/events/stream",
                    headers={"Last-Event-ID": str(last)},
                    timeout=None,
                ) as resp:
                    if resp.status_code != 200:
                        resp.read()
                        _json(resp)
                    for event in _parse_sse(resp.iter_lines()):
                        last = event["seq"]
                        yield event
                        if event["type"] == "state" and event["data"].get("state") in TERMINAL:
                            return
                return
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                time.sleep(1)

    def logs(
        self, job_id: int, node: int = 0, rank: int = 0, offset: int = 0, attempt: int | None = None
    ) -> tuple[bytes, int]:
        resp = self._logs(job_id, node, rank, offset, attempt)
        return resp.content, int(resp.headers.get("X-Next-Offset", offset))

    @_retry_connect
    def _logs(self, job_id: int, node: int, rank: int, offset: int, attempt: int | None) -> httpx.Response:
        params = {"node": node, "rank": rank, "offset": offset}
        if attempt is not None:
            params["attempt"] = attempt
        resp = self.http.get(f"/v1/jobs/{job_id}/logs", params=params)
        if resp.status_code >= 400:
            _json(resp)
        return resp

    def cancel(self, job_id: int) -> dict[str, Any]:
        return _json(self.http.post(f"/v1/jobs/{job_id}/cancel"))

    def checkpoints(self, job_id: int) -> list[dict[str, Any]]:
        return self._get(f"/v1/jobs/{job_id}/checkpoints")["items"]

    def checkpoint(self, ckpt_id: int) -> dict[str, Any]:
        return self._get(f"/v1/checkpoints/{ckpt_id}")

    def upload(self, path: str, name: str | None = None) -> dict[str, Any]:
        import os

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as fh:
                while chunk := fh.read(1024 * 1024):
                    yield chunk

        return _json(
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

    def download(self, ckpt_id: int, dest: str, progress: Any = None) -> str:
        from service.download import download_checkpoint

        return download_checkpoint(self, ckpt_id, dest, progress)


def _json(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail")
        except (ValueError, AttributeError):
            detail = resp.text
        raise ApiError(resp.status_code, detail)
    return resp.json()


def _parse_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield json.loads("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
