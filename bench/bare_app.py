"""The floor of the API benchmark: a bare FastAPI app served by uvicorn exactly as `torchjobs
server` serves its app (service/cli/processes.py `run_server`).

    python -m bench.bare_app PORT [PAGE_JSON [SERIES_JSON...]]

Routes are plain `def` functions like most of torchjobs' own, so both pay FastAPI's thread-pool
hop: `GET /v1/things/{id}` returns a small JSON dict, `POST /v1/things` parses a small pydantic
body. `GET /v1/async-things/{id}` is the same GET as an `async def`, with no hop.
`GET /v1/things` answers the JSON of a page of `GET /v1/jobs`, read from the file
`python -m bench.bare_app PORT PAGE_JSON` names. `GET /v1/series/{name}` answers the bytes of
the SERIES_JSON file `name.json` as they are, the floor of `GET /v1/jobs/{id}/metrics`.
`POST /v1/inserted-things` (with TJ_BENCH_DATABASE_URL) parses the same body and inserts a
job and its first event.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Engine, create_engine, text

app = FastAPI()


class Entrypoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str
    model: str
    dataset: str


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    mode: str
    gpus_per_node: int = Field(1, ge=1)
    entrypoint: Entrypoint
    hyperparameters: dict[str, Any] = Field(default_factory=dict)


@app.get("/v1/things/{thing_id}")
def get_thing(thing_id: int) -> dict[str, Any]:
    return {"id": thing_id, "name": "bench", "state": "queued", "mode": "single", "gpus_per_node": 1}


@app.get("/v1/async-things/{thing_id}")
async def get_thing_async(thing_id: int) -> dict[str, Any]:
    """The same on the event loop, without the thread hop: the floor for torchjobs' GET of
    one job, which is an `async def` answered from memory when it can be."""
    return {"id": thing_id, "name": "bench", "state": "queued", "mode": "single", "gpus_per_node": 1}


@app.post("/v1/things", status_code=201)
def post_thing(body: Body) -> dict[str, Any]:
    return {"id": 1, "state": "queued", **body.model_dump()}


# `POST /v1/inserted-things`: the floor that matters for `POST /v1/jobs` (bench/submit.py): the
# same body parsed, then a job row and its first event inserted in one transaction, with the
# same driver (psycopg through a SQLAlchemy Core engine and its pool), into the database named
# by TJ_BENCH_DATABASE_URL; nothing else (no token, no validation, no quota, no ORM).
INSERT_JOB = text(
    "INSERT INTO jobs (owner_id, name, state, mode, nodes, gpus_per_node, entrypoint, hyperparameters,"
    " env, labels, max_retries, priority, attempt, last_event_seq, created_at, queued_at)"
    " VALUES (:owner, :name, 'queued', :mode, 1, :gpus, CAST(:entrypoint AS json),"
    " CAST(:hyper AS json), '{}', '{}', 0, 0, 1, 1, now(), now()) RETURNING id"
)
INSERT_EVENT = text(
    "INSERT INTO job_events (job_id, seq, ts, type, data)"
    " VALUES (:job, 1, now(), 'state', '{\"state\": \"queued\"}')"
)
ENGINE: list[Engine] = []


@app.post("/v1/inserted-things", status_code=201)
def post_inserted_thing(body: Body) -> dict[str, Any]:
    with ENGINE[0].begin() as conn:
        owner: int = conn.execute(text("SELECT id FROM users WHERE name = 'admin'")).scalar_one()
        values = {
            "owner": owner,
            "name": body.name,
            "mode": body.mode,
            "gpus": body.gpus_per_node,
            "entrypoint": body.entrypoint.model_dump_json(),
            "hyper": json.dumps(body.hyperparameters),
        }
        job_id: int = conn.execute(INSERT_JOB, values).scalar_one()
        conn.execute(INSERT_EVENT, {"job": job_id})
    return {"id": job_id, "state": "queued", **body.model_dump()}


# `GET /v1/things`: the same JSON as a page of `GET /v1/jobs`, which the benchmark saves to the
# file named by the second argument before it starts this app; a `def` returning it as Python
# data, which FastAPI encodes, as any endpoint that builds its answer does.
PAGE: dict[str, Any] = {}


@app.get("/v1/things")
def list_things() -> dict[str, Any]:
    return PAGE


# `GET /v1/series/{name}`: the bytes of a `GET /v1/jobs/{id}/metrics` answer, saved by
# bench/metrics_read.py to a file named on the command line; a `def` (as the service's route
# is) answering them from memory as they are: the service's route splices its body too.
SERIES: dict[str, bytes] = {}


@app.get("/v1/series/{name}")
def get_series(name: str) -> Response:
    if name not in SERIES:
        raise HTTPException(404)
    return Response(SERIES[name], media_type="application/json")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        PAGE.update(json.loads(Path(sys.argv[2]).read_text()))
    SERIES.update({Path(f).stem: Path(f).read_bytes() for f in sys.argv[3:]})
    if os.environ.get("TJ_BENCH_DATABASE_URL"):
        url = os.environ["TJ_BENCH_DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://", 1)
        ENGINE.append(create_engine(url, pool_size=40, max_overflow=0))
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
