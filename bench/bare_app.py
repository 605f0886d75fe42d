"""The floor of the API benchmark: a bare FastAPI app served by uvicorn exactly as `torchjobs
server` serves its app (service/cli/processes.py `run_server`).

    python -m bench.bare_app PORT [PAGE_JSON [SERIES_JSON...]]

Routes are plain `def` functions like most of torchjobs' own, so both pay FastAPI's thread-pool
hop: `GET /v1/things/{id}` returns a small JSON dict, `POST /v1/things` parses a small pydantic
body. `GET /v1/async-things/{id}` is the same GET as an `async def`, with no hop.
`GET /v1/things` answers the JSON of a page of `GET /v1/jobs`, read from the file
`python -m bench.bare_app PORT PAGE_JSON` names. `GET /v1/series/{name}` answers the bytes of
the SERIES_JSON file `name.json` as they are, the floor of `GET /v1/jobs/{id}/metrics`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel, ConfigDict, Field

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
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
