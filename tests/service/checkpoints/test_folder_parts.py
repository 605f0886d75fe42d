"""Every node's part of a folder checkpoint (contract §11), against a real database built by the
migrations and a real file:// storage: listed only once every node's part is stored (or absent),
in one go, the lowest node's copy of a shared path kept; nothing half listed, nothing orphaned."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from service.checkpoints import folders
from service.checkpoints.recording import delete_checkpoint
from service.config import Settings
from service.db import Database
from service.errors import Conflict
from service.jobs.states import transition_node
from service.migrate import upgrade
from service.models import Checkpoint, CheckpointFile, CheckpointPart, NodeRun, User
from service.nodes.values import NodeKey
from service.storage import Storage
from tests.factories import make_job, make_node_run


class Changed(OSError):
    pass


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    settings = Settings(home=tmp_path, database_url=url)
    upgrade(settings)
    database = Database(settings)
    yield database
    database.dispose()


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return Storage(f"file://{tmp_path / 'store'}")


def job_of(db: Database, nodes: int = 2) -> tuple[int, User]:
    with db.transaction() as s:
        user = User(name="u", token_hash="0" * 64)
        s.add(user)
        s.flush()
        job = make_job(
            s, user.id, "running", entrypoint={"kind": "script", "path": "x.py", "args": []}, nodes=nodes
        )
        for rank in range(nodes):
            make_node_run(s, job, "running", node_rank=rank, worker_name=f"w{rank}")
        s.expunge(user)
        return job.id, user


def store(db: Database, storage: Storage, key: NodeKey, files: dict[str, bytes], name: str = "step-1") -> int:
    sigs = [(path, len(data), 0, i) for i, (path, data) in enumerate(sorted(files.items()))]
    part = folders.store_part(db, storage, key, name, 0, sigs, lambda sig: io.BytesIO(files[sig[0]]))
    assert part is not None
    return part


def listed_files(db: Database, ckpt_id: int) -> list[tuple[str, int, str]]:
    with db.read() as s:
        rows = s.execute(select(CheckpointFile).where(CheckpointFile.checkpoint_id == ckpt_id)).scalars()
        return sorted((r.path, r.node_rank, r.storage_key) for r in rows)


def objects(storage: Storage) -> list[str]:
    return storage.list("jobs")


def test_listed_once_every_node_looked_lowest_rank_wins(db: Database, storage: Storage) -> None:
    job_id, _ = job_of(db)
    n0, n1 = (NodeKey(job_id=job_id, attempt=1, node_rank=r) for r in (0, 1))
    store(db, storage, n1, {"rng_state_1.pth": b"r1", "config.json": b"from node 1"})
    lead = store(
        db, storage, n0, {"rng_state_0.pth": b"r0", "config.json": b"from node 0", ".metadata": b"m"}
    )
    assert folders.try_list(db, storage, n0, lead, 2, {"step": 5}) is None  # node 1 has not looked since
    folders.note_look(db, n1, folders.part_horizon(db), ["step-1"])  # it holds the name unstored
    assert folders.try_list(db, storage, n0, lead, 2, {"step": 5}) is None
    folders.note_look(db, n1, folders.part_horizon(db), [])
    ckpt_id = folders.try_list(db, storage, n0, lead, 2, {"step": 5})
    assert ckpt_id is not None
    files = listed_files(db, ckpt_id)
    assert [(p, r) for p, r, _ in files] == [
        (".metadata", 0), ("config.json", 0), ("rng_state_0.pth", 0), ("rng_state_1.pth", 1)
    ]  # fmt: skip
    config_key = next(k for p, _, k in files if p == "config.json")
    assert Path(storage.local_path(config_key) or "").read_bytes() == b"from node 0"
    with db.read() as s:
        ckpt = s.get(Checkpoint, ckpt_id)
        assert ckpt is not None
        rows = [(".metadata", b"m"), ("config.json", b"from node 0"), ("rng_state_0.pth", b"r0")]
        rows.append(("rng_state_1.pth", b"r1"))
        manifest = b"".join(f"{hashlib.sha256(d).hexdigest()} {len(d)} {p}\n".encode() for p, d in rows)
        assert (ckpt.kind, ckpt.files, ckpt.step) == ("folder", 4, 5)
        assert ckpt.sha256 == hashlib.sha256(manifest).hexdigest()
        assert ckpt.size_bytes == sum(len(d) for _, d in rows)
    # both nodes end: node 1's unused copy of config.json goes, every listed object stays
    with db.transaction() as s:
        for run in s.execute(select(NodeRun).where(NodeRun.job_id == job_id)).scalars():
            assert transition_node(run, "succeeded")
    folders.end_node(db, storage, n0)
    assert sorted(objects(storage)) == sorted(k for _, _, k in files)


def test_a_node_without_the_folder_counts_as_absent(db: Database, storage: Storage) -> None:
    job_id, _ = job_of(db)
    n0, n1 = (NodeKey(job_id=job_id, attempt=1, node_rank=r) for r in (0, 1))
    lead = store(db, storage, n0, {"trainer_state.json": b"{}"})
    folders.note_look(db, n1, folders.part_horizon(db), [])
    ckpt_id = folders.try_list(db, storage, n0, lead, 2, None)
    assert ckpt_id is not None
    assert [p for p, _, _ in listed_files(db, ckpt_id)] == ["trainer_state.json"]
    # tried again (its first commit answered with an error): gone, not "later", so node 0,
    # which lists in order, does not keep it at the head of its list for ever
    assert folders.try_list(db, storage, n0, lead, 2, None) == folders.GONE


def test_a_node_that_succeeded_before_node_0_saved_does_not_hold_the_listing(
    db: Database, storage: Storage
) -> None:
    """Node 1's ranks exit first; node 0 writes its last folder after node 1's last look (its
    coordinator writes `.metadata` last). Once node 1 has succeeded, its stored parts are all
    it will ever have: the folder is listed, with node 1's part."""
    job_id, _ = job_of(db)
    n0, n1 = (NodeKey(job_id=job_id, attempt=1, node_rank=r) for r in (0, 1))
    store(db, storage, n1, {"__1_0.distcp": b"s1"}, name="epoch-12")
    folders.note_look(db, n1, folders.part_horizon(db), [])
    lead = store(db, storage, n0, {"__0_0.distcp": b"s0", ".metadata": b"m"}, name="epoch-12")
    assert folders.try_list(db, storage, n0, lead, 2, None) is None  # node 1 runs: it may still look
    with db.transaction() as s:
        run = s.execute(select(NodeRun).where(NodeRun.job_id == job_id, NodeRun.node_rank == 1)).scalar_one()
        assert transition_node(run, "succeeded")
    ckpt_id = folders.try_list(db, storage, n0, lead, 2, None)
    assert ckpt_id is not None
    assert [(p, r) for p, r, _ in listed_files(db, ckpt_id)] == [
        (".metadata", 0), ("__0_0.distcp", 0), ("__1_0.distcp", 1)
    ]  # fmt: skip


def test_a_lost_node_holds_the_listing_a_part_may_be_missing(db: Database, storage: Storage) -> None:
    job_id, _ = job_of(db)
    n0, n1 = (NodeKey(job_id=job_id, attempt=1, node_rank=r) for r in (0, 1))
    folders.note_look(db, n1, folders.part_horizon(db), [])
    lead = store(db, storage, n0, {"__0_0.distcp": b"s0", ".metadata": b"m"}, name="epoch-12")
    with db.transaction() as s:
        run = s.execute(select(NodeRun).where(NodeRun.job_id == job_id, NodeRun.node_rank == 1)).scalar_one()
        assert transition_node(run, "lost", error="worker lost")
    assert folders.try_list(db, storage, n0, lead, 2, None) is None


def test_a_node_lost_mid_upload_leaves_nothing_listed_nor_stored(db: Database, storage: Storage) -> None:
    job_id, _ = job_of(db)
    n0, n1 = (NodeKey(job_id=job_id, attempt=1, node_rank=r) for r in (0, 1))
    lead = store(db, storage, n0, {"a": b"a"})
    # node 1 began its part, stored one object, and its host died: its row says "storing"
    with db.transaction() as s:
        s.add(CheckpointPart(job_id=job_id, attempt=1, node_rank=1, name="step-1", version=0, phase="storing",
                             prefix=f"jobs/{job_id}/attempt-1/step-1/v0-n1-x/", files=[]))  # fmt: skip
    storage.put_stream(iter([b"half"]), f"jobs/{job_id}/attempt-1/step-1/v0-n1-x/b")
    folders.note_look(db, n1, folders.part_horizon(db), [])
    assert folders.try_list(db, storage, n0, lead, 2, None) is None  # a part still storing
    with db.transaction() as s:
        for run in s.execute(select(NodeRun).where(NodeRun.job_id == job_id)).scalars():
            assert transition_node(run, "lost" if run.node_rank == 1 else "failed")
    folders.end_node(db, storage, n0)
    with db.read() as s:
        assert s.execute(select(Checkpoint)).first() is None
        assert s.execute(select(CheckpointPart)).first() is None
    assert objects(storage) == []


def test_a_lost_node_that_ends_last_leaves_nothing_orphaned(db: Database, storage: Storage) -> None:
    """Node 0 ended first; node 1's host dies mid-upload. No node is left to clean up: the
    scheduler pass that loses node 1 drops the attempt's unlisted parts and their objects."""
    from service.scheduler.placement_pass import run_pass

    job_id, _ = job_of(db)
    n0 = NodeKey(job_id=job_id, attempt=1, node_rank=0)
    store(db, storage, n0, {"a": b"a"})
    with db.transaction() as s:
        s.add(CheckpointPart(job_id=job_id, attempt=1, node_rank=1, name="step-1", version=0, phase="storing",
                             prefix=f"jobs/{job_id}/attempt-1/step-1/v0-n1-x/", files=[]))  # fmt: skip
        run0 = s.execute(select(NodeRun).where(NodeRun.job_id == job_id, NodeRun.node_rank == 0)).scalar_one()
        assert transition_node(run0, "failed")
    storage.put_stream(iter([b"half"]), f"jobs/{job_id}/attempt-1/step-1/v0-n1-x/b")
    folders.end_node(db, storage, n0)  # node 1 still runs: nothing goes yet
    assert objects(storage) != []
    db.settings.storage_url = storage.url
    run_pass(db, db.settings, dispatch=lambda _: None)  # w1 has no heartbeat: node 1 is lost
    with db.read() as s:
        assert s.execute(select(CheckpointPart)).first() is None
    assert objects(storage) == []


def test_a_file_changed_while_stored_leaves_no_part(db: Database, storage: Storage) -> None:
    job_id, _ = job_of(db, nodes=1)
    key = NodeKey(job_id=job_id, attempt=1, node_rank=0)

    def opener(sig: tuple[str, int, int, int]) -> io.BytesIO:
        if sig[0] == "b":
            raise Changed("b: changed since the look")
        return io.BytesIO(b"a")

    with pytest.raises(Changed):
        folders.store_part(db, storage, key, "s", 0, [("a", 1, 0, 1), ("b", 1, 0, 2)], opener)
    with db.read() as s:
        assert s.execute(select(CheckpointPart)).first() is None
    assert objects(storage) == []


def test_delete_a_folder_checkpoint_takes_its_objects(db: Database, storage: Storage) -> None:
    job_id, user = job_of(db, nodes=1)
    key = NodeKey(job_id=job_id, attempt=1, node_rank=0)
    first = folders.try_list(db, storage, key, store(db, storage, key, {"x": b"1"}), 1, None)
    second = folders.try_list(db, storage, key, store(db, storage, key, {"x": b"2"}, "step-2"), 1, None)
    assert first is not None and second is not None
    with pytest.raises(Conflict):  # its running job's newest: a retry resumes from it
        delete_checkpoint(db, storage, user, second)
    delete_checkpoint(db, storage, user, first)
    assert [k.split("/")[3] for k in objects(storage)] == ["step-2"]


def test_a_retention_that_fails_does_not_fail_the_listing(
    db: Database, storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention (keep_checkpoints) runs after the listing committed. If it fails (the database
    away a moment when it reads the job), the checkpoint stays listed and the try says so:
    raised, node 0 would await a part already listed and gone until its end."""
    from service.checkpoints import recording

    job_id, _ = job_of(db, nodes=1)
    key = NodeKey(job_id=job_id, attempt=1, node_rank=0)

    def away(*_: object) -> None:
        raise OSError("database away")

    monkeypatch.setattr(recording.jobs_repo, "job_by_id", away)
    lead = store(db, storage, key, {"trainer_state.json": b"{}"})
    ckpt_id = folders.try_list(db, storage, key, lead, 1, None)
    assert ckpt_id is not None
    assert [p for p, _, _ in listed_files(db, ckpt_id)] == ["trainer_state.json"]
    with db.read() as s:
        assert s.execute(select(CheckpointPart)).first() is None  # the part became the checkpoint
