"""Folder checkpoints taken as frameworks write them (contract §11), on a real embedded stack
with torchrun: every rank's files listed in one checkpoint, a slow writer never listed half
written, `keep_checkpoints`, `DELETE` and its 409, and a retried attempt that finds its
checkpoint back in its checkpoint folder. One stack for the module; jobs of a few seconds.
The script is tests/scripts/folder_writer.py."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from service.testing import harness
from service.testing.harness import Stack, wait_for
from tests.redis_dbs import fresh_redis_url, release_redis_url

SETTLE_S = 6  # longer than the slow writer's 4 s pause: the folder must not settle in it


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, module_pg_url: str) -> Iterator[Stack]:
    home = Path(tmp_path_factory.mktemp("folder-ckpts"))
    redis = fresh_redis_url()
    settle = {"TORCHJOBS_CHECKPOINT_SETTLE_S": str(SETTLE_S)}
    # two workers on this machine: a 2-node job's nodes each write in their own run folder
    stack = harness.production_stack(home, module_pg_url, redis, workers={"w1": 2, "w2": 1}, **settle)
    yield stack
    stack.stop()
    release_redis_url(redis)


def run(stack: Stack, case: str, **spec: Any) -> dict[str, Any]:
    job = stack.submit(
        {
            "mode": spec.pop("mode", "single"),
            "entrypoint": {"kind": "script", "path": "folder_writer.py"},
            "env": {"FOLDER_CASE": case},
            **spec,
        }
    )
    done = stack.wait_job(job["id"], timeout=300)
    if done["state"] != "succeeded":
        done = {"error": done.get("error"), **done}  # first: pytest cuts a long message short
        with stack.client() as c:
            done["log"] = c.get(f"/v1/jobs/{job['id']}/logs").text[-3000:]
        done["events"] = stack.events(job["id"])
        Path(f"/tmp/folder-ckpt-{job['id']}.json").write_text(json.dumps(done, indent=1))
    return done


def checkpoints(stack: Stack, job_id: int) -> list[dict[str, Any]]:
    with stack.client() as c:
        resp = c.get(f"/v1/jobs/{job_id}/checkpoints")
    assert resp.status_code == 200, resp.text
    return list(resp.json()["items"])


def files_in_db(stack: Stack, ckpt_id: int) -> list[tuple[str, int, str, int, str]]:
    """The rows as recorded (the serving routes are another engineer's; these are the records)."""
    engine = create_engine(stack.env["TORCHJOBS_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT path, size_bytes, sha256, node_rank, storage_key FROM checkpoint_files "
                    "WHERE checkpoint_id = :i ORDER BY path"
                ),
                {"i": ckpt_id},
            ).all()
    finally:
        engine.dispose()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def stored(stack: Stack, key: str) -> Path:
    return stack.home / "shared-storage" / key


def test_every_rank_s_files_are_one_folder_checkpoint(stack: Stack) -> None:
    done = run(stack, "ranks", mode="ddp", gpus_per_node=2)
    assert done["state"] == "succeeded", done
    (ckpt,) = checkpoints(stack, done["id"])
    assert (ckpt["name"], ckpt["kind"], ckpt["files"]) == ("step-1", "folder", 4)
    assert (ckpt["epoch"], ckpt["step"]) == (1, 1)
    rows = files_in_db(stack, ckpt["id"])
    assert [r[0] for r in rows] == ["model/weights.bin", "rank-0.bin", "rank-1.bin", "trainer_state.json"]
    assert all(r[3] == 0 for r in rows)
    for path, size, sha, _node, key in rows:
        data = stored(stack, key).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha), path
    assert stored(stack, rows[1][4]).read_bytes() == b"rank 0" * 100
    manifest = b"".join(f"{sha} {size} {path}\n".encode() for path, size, sha, _n, _k in rows)
    assert ckpt["sha256"] == hashlib.sha256(manifest).hexdigest()
    assert ckpt["size_bytes"] == sum(r[1] for r in rows)


def test_a_slow_writer_is_never_listed_half_written(stack: Stack) -> None:
    done = run(stack, "slow")
    assert done["state"] == "succeeded", done
    listed = checkpoints(stack, done["id"])
    assert [(c["name"], c["files"]) for c in listed] == [("slow", 2)]


def test_keep_checkpoints_and_delete(stack: Stack) -> None:
    with stack.client() as c:
        bad = c.post(
            "/v1/jobs",
            json={
                "mode": "single",
                "entrypoint": {"kind": "script", "path": "hello.py"},
                "keep_checkpoints": 0,
            },
        )
    assert bad.status_code == 422 and "keep_checkpoints" in bad.text
    done = run(stack, "keep", keep_checkpoints=1)
    assert done["state"] == "succeeded", done
    events = [e for e in stack.events(done["id"]) if e["type"] == "checkpoint"]
    assert [e["data"]["name"] for e in events] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    (kept,) = checkpoints(stack, done["id"])
    assert kept["name"] == "ckpt-3"
    gone = [e["data"]["id"] for e in events[:2]]
    folder = stored(stack, f"jobs/{done['id']}")
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert all(p.startswith("attempt-1/ckpt-3/") for p in left), left
    with stack.client() as c:
        assert c.get(f"/v1/checkpoints/{gone[0]}").status_code == 404
        usage = c.get("/v1/usage").json()["items"]
        assert sum(u["checkpoint_bytes"] for u in usage) >= kept["size_bytes"]
        # a queued job that will resume from it (it waits for a sleeping one): 409, nothing changes
        sleeper = stack.submit(
            {"mode": "single", "entrypoint": {"kind": "script", "path": "folder_writer.py"},
             "env": {"FOLDER_CASE": "sleep"}}
        )  # fmt: skip
        waiting = stack.submit(
            {
                "mode": "single",
                "entrypoint": {"kind": "script", "path": "hello.py"},
                "resume_from": {"checkpoint_id": kept["id"]},
                "depends_on": [{"job_id": sleeper["id"]}],
            }
        )
        assert c.delete(f"/v1/checkpoints/{kept['id']}").status_code == 409
        assert c.get(f"/v1/checkpoints/{kept['id']}").status_code == 200
        for job in (waiting, sleeper):
            c.post(f"/v1/jobs/{job['id']}/cancel")
            stack.wait_job(job["id"], timeout=120)
        assert c.delete(f"/v1/checkpoints/{kept['id']}").status_code == 204
        assert c.delete(f"/v1/checkpoints/{kept['id']}").status_code == 404
    assert not [p for p in folder.rglob("*") if p.is_file()]


def test_a_retried_attempt_finds_its_checkpoint_in_its_folder(stack: Stack) -> None:
    done = run(stack, "retry", max_retries=1)
    assert done["state"] == "succeeded", done
    assert done["attempt"] == 2
    listed = checkpoints(stack, done["id"])
    assert [(c["name"], c["files"]) for c in listed] == [("state", 2)]  # the copy was not taken again
    with stack.client() as c:
        log = c.get(f"/v1/jobs/{done['id']}/logs").text
    found = json.loads(log.split("FOUND ", 1)[1].splitlines()[0])
    resumed = json.loads(log.split("RESUME ", 1)[1].splitlines()[0])
    expected = {"weights.bin": "v1" * 500, "trainer_state.json": "{}"}
    assert found == expected
    assert resumed == expected


def test_a_checkpoint_of_two_nodes_lists_the_files_of_both(stack: Stack) -> None:
    done = run(stack, "nodes", mode="ddp", nodes=2, gpus_per_node=1)
    assert done["state"] == "succeeded", done
    assert {a["worker"] for a in done["assignments"]} == {"w1", "w2"}
    (ckpt,) = checkpoints(stack, done["id"])
    assert (ckpt["name"], ckpt["kind"], ckpt["files"]) == ("dcp", "folder", 4)
    rows = {r[0]: r for r in files_in_db(stack, ckpt["id"])}
    assert {p: r[3] for p, r in rows.items()} == {
        ".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1, "common.json": 0
    }  # fmt: skip
    assert stored(stack, rows["common.json"][4]).read_bytes() == b"node 0"  # the lowest node's copy
    assert stored(stack, rows["__1_0.distcp"][4]).read_bytes() == b"shard 1" * 50
    # node 1's unused copy of common.json is gone once both nodes ended: no orphan object
    folder, root = stored(stack, f"jobs/{done['id']}"), stored(stack, "")

    def only_listed() -> bool:
        held = {str(p.relative_to(root)) for p in folder.rglob("*") if p.is_file()}
        return held == {r[4] for r in rows.values()}

    wait_for(only_listed, 30, "only the listed objects left in storage")
