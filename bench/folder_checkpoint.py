"""A folder checkpoint written by two nodes (contract §11): from its last byte written to its
listing, against `cp -r` of the same files; and its download, against reading the same files
from disk (issue #36).

    .venv/bin/python -m bench.folder_checkpoint            # 1 GiB (512 MiB a node), 3 runs; ~5 min
    .venv/bin/python -m bench.folder_checkpoint --smoke    # 64 MiB, 1 run

On `torchjobs db upgrade` + `server` + two `worker --accelerator cpu --gpus 1` (one node each),
PostgreSQL, Redis and `file://` storage on the same disk, the product's default settings. The
job (`ddp`, 2 nodes x 1 rank, a script pushed as the job's code) has each rank write its half
as `dcp/__RANK_0.distcp` (random bytes, written in 8 MiB pieces), meet at a gloo barrier, and
rank 0 write DCP's `.metadata` last, then print the time of that last byte. Measured:
1. listing: from that last byte to the `checkpoint` event (the checkpoint listed, both nodes'
   parts hashed and stored). Floor: `cp -r` of a folder of the same two files, written by
   this process just before (so in the page cache, as the rank's were), into a new folder on
   the same disk.
2. download: `GET /v1/checkpoints/{id}/download` (the deterministic tar), read to its end by
   one httpx client. Floor: reading the same two files from disk in 1 MiB pieces.
Service and floor alternate, the one going first swapping every run.

Nothing is asserted on the times.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    REPO,
    failure_notes,
    figure,
    parse_ts,
    print_figures,
    production_stack,
    workdir,
    write_result,
)
from service.client.api import Client
from service.testing import harness

CHUNK = 8 * 1024 * 1024
SCRIPT = """
import os, sys, time
import torch.distributed as dist

half = int(sys.argv[1])
rank = int(os.environ["RANK"])
folder = os.path.join(os.environ["TORCHJOBS_CHECKPOINT_DIR"], "dcp")
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, f"__{rank}_0.distcp"), "wb") as fh:
    left = half
    while left:
        piece = min(left, 8 * 1024 * 1024)
        fh.write(os.urandom(piece))
        left -= piece
dist.init_process_group("gloo")
dist.barrier()
if rank == 0:
    with open(os.path.join(folder, ".metadata"), "wb") as fh:
        fh.write(b"metadata")
    print(f"LAST-BYTE {time.time():.6f}", flush=True)
dist.barrier()
time.sleep(2)
"""


def checkpoint_listed(stack: harness.Stack, job_id: int, timeout: float) -> tuple[dict[str, Any], float]:
    """The checkpoint event's data and its storing time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with stack.client() as c:
            events = c.get(f"/v1/jobs/{job_id}/events").json()["items"]
        for e in events:
            if e["type"] == "checkpoint":
                return e["data"], parse_ts(e["ts"])
        time.sleep(0.2)
    raise RuntimeError(f"job {job_id}: no checkpoint listed in {timeout:.0f} s: {stack.describe(job_id)}")


def listing_run(stack: harness.Stack, code: str, half: int) -> dict[str, Any]:
    spec = {
        "mode": "ddp",
        "nodes": 2,
        "gpus_per_node": 1,
        "code": code,
        "entrypoint": {"kind": "script", "path": "write_dcp.py", "args": [str(half)]},
    }
    job = stack.submit(spec)
    data, listed = checkpoint_listed(stack, job["id"], 600)
    done = stack.wait_job(job["id"], timeout=300)
    if done["state"] != "succeeded":
        raise RuntimeError(f"job {job['id']} ended {done['state']}: {stack.describe(job['id'])}")
    with stack.client() as c:
        log = c.get(f"/v1/jobs/{job['id']}/logs", params={"node": 0, "rank": 0}).text
    found = re.search(r"LAST-BYTE ([\d.]+)", log)
    if not found:
        raise RuntimeError(f"job {job['id']}: no LAST-BYTE line in its log")
    with stack.client() as c:
        ckpt = c.get(f"/v1/checkpoints/{data['id']}").json()
    if ckpt["size_bytes"] != 2 * half + len(b"metadata"):
        raise RuntimeError(f"checkpoint {data['id']} holds {ckpt['size_bytes']} bytes")
    return {"listing_s": listed - float(found.group(1)), "checkpoint": ckpt}


def cp_run(scratch: Path, half: int) -> float:
    src, dst = scratch / "src", scratch / "dst"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(dst, ignore_errors=True)
    (src / "dcp").mkdir(parents=True)
    for rank in (0, 1):
        with open(src / "dcp" / f"__{rank}_0.distcp", "wb") as fh:
            left = half
            while left:
                piece = min(left, CHUNK)
                fh.write(os.urandom(piece))
                left -= piece
    (src / "dcp" / ".metadata").write_bytes(b"metadata")
    started = time.monotonic()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return time.monotonic() - started


def download_run(stack: harness.Stack, ckpt: dict[str, Any]) -> float:
    started = time.monotonic()
    got = 0
    with (
        httpx.Client(base_url=stack.url, headers=harness.auth(), timeout=300) as c,
        c.stream("GET", ckpt["download_url"]) as resp,
    ):
        resp.raise_for_status()
        for piece in resp.iter_raw(1024 * 1024):
            got += len(piece)
    if got < ckpt["size_bytes"]:
        raise RuntimeError(f"the tar held {got} bytes, under the checkpoint's {ckpt['size_bytes']}")
    return time.monotonic() - started


def read_run(scratch: Path) -> float:
    started = time.monotonic()
    for path in sorted((scratch / "src" / "dcp").iterdir()):
        with open(path, "rb") as fh:
            while fh.read(1024 * 1024):
                pass
    return time.monotonic() - started


def measure(runs: int, half: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    artifacts = REPO / "test-artifacts" / "bench" / "folder-checkpoint"
    with (
        workdir("tj-bench-folder-", keep_on_error=artifacts) as scratch,
        production_stack(scratch / "stack", {"w1": 1, "w2": 1}) as (stack, _),
    ):
        project = scratch / "project"
        project.mkdir()
        (project / "write_dcp.py").write_text(SCRIPT)
        with Client(stack.url, harness.ADMIN_TOKEN) as client:
            code = client.push_code(project)["id"]
        for i in range(runs):
            run: dict[str, Any] = {}
            try:
                order = ["service", "floor"] if i % 2 == 0 else ["floor", "service"]
                for side in order:
                    if side == "service":
                        got = listing_run(stack, code, half)
                        run["listing_s"] = got["listing_s"]
                        run["download_s"] = download_run(stack, got["checkpoint"])
                    else:
                        run["cp_s"] = cp_run(scratch, half)
                        run["read_s"] = read_run(scratch)
            except Exception as exc:  # a figure from fewer runs says so
                run = {"error": str(exc)}
            out.append(run)
            print(f"  run {i + 1}: {run}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mib", type=int, default=1024, help="the checkpoint's size, both nodes")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.mib = 1, 64
    half = args.mib * 1024 * 1024 // 2
    runs = measure(args.runs, half)
    ok = [r for r in runs if "error" not in r]
    setup = f"{args.mib} MiB from 2 nodes (2 workers, one disk)"
    result = {
        "name": "folder-checkpoint",
        "title": "A folder checkpoint from two nodes: last byte to listed, and its download",
        "figures": [
            figure(
                "folder checkpoint, last byte written -> listed",
                "s",
                [r["listing_s"] for r in ok],
                [r["cp_s"] for r in ok],
                setup=setup,
                floor_name="cp -r of the same files",
            ),
            figure(
                "folder checkpoint download (tar), whole body",
                "s",
                [r["download_s"] for r in ok],
                [r["read_s"] for r in ok],
                setup=setup,
                floor_name="reading the same files from disk",
            ),
        ],
        "notes": failure_notes("folder checkpoint", runs),
        "raw": runs,
    }
    write_result(args.json, result)
    print_figures(result)
    return 1 if len(ok) < len(runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
