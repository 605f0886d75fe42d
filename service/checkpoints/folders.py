"""Folder checkpoints from every node (contract §11): parts stored, listed whole, never orphaned.

Each node's supervisor stores its own part of a folder name: a row in `checkpoint_parts` first
("storing", with the prefix every one of its objects will have), then each file as its own
object (read once from the descriptor the worker checked, hashed on the way), then the row
"stored" with the files. Node 0's part is stored when the folder is complete there by the rules;
another node's when it is unchanged over two looks. A node also notes after each look which names
it still holds unstored (`checkpoint_looks`), with the newest part id it knew of before it looked.

Node 0's part becomes a Checkpoint, in one transaction, once every other node has looked at
its folder after that part was begun and found the name stored or absent: a listed checkpoint
is always whole. Where two nodes hold the same path, the lowest node rank's copy is kept.

Parts never listed are deleted, objects and all, once every node of their attempt has ended
(`end_node`): a node lost mid-upload leaves its "storing" row, and so its prefix, behind.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from sqlalchemy.orm import Session

from service.checkpoints import repository as repo
from service.checkpoints.manifest import manifest_of
from service.checkpoints.recording import record_checkpoint, retain, unreferenced_in
from service.db import Database
from service.jobs import repository as jobs_repo
from service.jobs.reports import touch_report
from service.jobs.states import lock_job
from service.models import Checkpoint, CheckpointFile, CheckpointLook, CheckpointPart
from service.models.base import utcnow
from service.nodes.values import NodeKey
from service.states import NodeState
from service.storage import Storage

log = logging.getLogger("torchjobs.checkpoints")
FileSig = tuple[str, int, int, int]  # path, size, mtime_ns, inode: as the worker's look saw it
StoredFile = tuple[str, int, str, str]  # path, size, sha256, storage key
NODE_ENDED = (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.CANCELLED, NodeState.LOST)


class Source(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


def folder_prefix(key: NodeKey, name: str) -> str:
    return f"jobs/{key.job_id}/attempt-{key.attempt}/{name}/"


def part_horizon(db: Database) -> int:
    """The newest part id: a node reads it before it looks, so its look counts for every part
    begun before (`note_look`)."""
    with db.read() as session:
        return repo.newest_part_id(session)


def store_part(
    db: Database,
    storage: Storage,
    key: NodeKey,
    name: str,
    version: int,
    files: Sequence[FileSig],
    open_file: Callable[[FileSig], Source],
) -> int | None:
    """Store this node's part of folder `name`; its part id, or None when the job is gone.

    A file that is not what the look saw any more raises (the worker's `CheckpointChanged`)
    after what was stored of the part is deleted: the folder is looked at again."""
    prefix = folder_prefix(key, name) + f"v{version}-n{key.node_rank}-{uuid.uuid4().hex[:12]}/"
    with db.transaction() as session:
        if jobs_repo.owner_of(session, key.job_id) is None:
            return None
        part = CheckpointPart(
            job_id=key.job_id,
            attempt=key.attempt,
            node_rank=key.node_rank,
            name=name,
            version=version,
            phase="storing",
            prefix=prefix,
            files=[],
        )
        part_id = repo.add_part(session, part).id
    try:
        stored = [_store_file(storage, prefix, sig, open_file) for sig in files]
    except BaseException:
        _drop_parts(db, storage, [part_id])
        raise
    superseded: list[int] = []
    with db.transaction() as session:
        row = repo.part(session, part_id)
        if row is None:  # its attempt ended and was cleaned meanwhile: nothing of it stays
            _delete_prefix(storage, prefix)
            return None
        row.phase, row.files, row.stored_at = "stored", [list(f) for f in stored], utcnow()
        if key.node_rank > 0:  # another node's newer part of the name replaces the older one
            superseded = repo.other_part_ids(session, row)
    _drop_parts(db, storage, superseded)
    return part_id


def _store_file(
    storage: Storage, prefix: str, sig: FileSig, open_file: Callable[[FileSig], Source]
) -> StoredFile:
    source = open_file(sig)
    try:
        key = prefix + sig[0]
        size, sha = storage.put_stream(_chunks(source), key)
    finally:
        source.close()
    return (sig[0], size, sha, key)


def _chunks(source: Source) -> Iterator[bytes]:
    return iter(lambda: source.read(1024 * 1024), b"")


def note_look(db: Database, key: NodeKey, horizon: int, busy: Sequence[str]) -> None:
    """This node looked at its checkpoint folder (having read `horizon` first): `busy` are the
    names it holds whose current form is not stored yet."""
    with db.transaction() as session:
        row = repo.look(session, key.job_id, key.attempt, key.node_rank)
        if row is None:
            row = CheckpointLook(job_id=key.job_id, attempt=key.attempt, node_rank=key.node_rank)
            repo.add_look(session, row)
        row.looked_at, row.horizon, row.busy = utcnow(), horizon, list(busy[:1000])


GONE = 0  # try_list: the part is awaited no more (listed already, or its job or attempt is gone)


def try_list(
    db: Database, storage: Storage, key: NodeKey, part_id: int, nnodes: int, meta: dict[str, Any] | None
) -> int | None:
    """Node 0's part `part_id` as a Checkpoint with every node's files, once every node's part is
    stored (or absent): its id. None while one is not (try again later). `GONE` when the part
    no longer exists: its job or attempt was removed, or a try whose commit answered with an
    error had listed it. Node 0 lists its parts in order, so such a part must not wait forever
    at the head of its list, holding back every later one."""
    with db.transaction() as session:
        job = lock_job(session, key.job_id)
        lead = repo.part(session, part_id)
        if job is None or lead is None:
            return GONE
        if lead.phase != "stored":
            return None
        parts = _others_ready(session, lead, nnodes)
        if parts is None:
            return None
        ckpt = _listed(session, job.owner_id, lead, parts, meta or {})
        session.delete(lead)
        touch_report(session, key)
        ckpt_id = ckpt.id
    retain(db, storage, key.job_id)
    return ckpt_id


def _others_ready(session: Session, lead: CheckpointPart, nnodes: int) -> list[CheckpointPart] | None:
    """Every other node's stored part of the name (none where it has none), or None while one
    has not looked since `lead` was begun, or still holds the name unstored."""
    looks = {row.node_rank: row for row in repo.looks_of(session, lead.job_id, lead.attempt)}
    ended = _ended_nodes(session, lead, nnodes)
    for rank in range(1, nnodes):
        look = looks.get(rank)
        if rank in ended:  # it stored its parts before it ended, and looks no more
            continue
        if look is None or look.horizon < lead.id or lead.name in look.busy:
            return None
    parts = repo.later_nodes_parts(session, lead)
    newest: dict[int, CheckpointPart] = {}
    for part in parts:
        if part.phase != "stored" and part.node_rank in ended:
            continue  # begun and never finished by a node that has ended: it never will be
        if part.phase != "stored":
            return None
        newest.setdefault(part.node_rank, part)
    return [newest[r] for r in sorted(newest)]


def _ended_nodes(session: Session, lead: CheckpointPart, nnodes: int) -> set[int]:
    """The other nodes of the attempt that have succeeded: their ranks exited 0 and each
    stored its parts and took its last look before it said so (node 0 may save after them,
    so a look of theirs never covers its last parts). Not a node that was lost or failed: it
    may never have taken that look, and a listed checkpoint is always whole."""
    ended = set()
    for rank in range(1, nnodes):
        run = jobs_repo.node_run(session, lead.job_id, lead.attempt, rank)
        if run is not None and run.state == NodeState.SUCCEEDED:
            ended.add(rank)
    return ended


def _listed(
    session: Session, owner: int, lead: CheckpointPart, others: list[CheckpointPart], meta: dict[str, Any]
) -> Checkpoint:
    chosen: dict[str, tuple[StoredFile, int]] = {}
    for part in [lead, *others]:  # lowest node rank first: its copy of a path is kept
        for path, size, sha, obj in part.files:
            chosen.setdefault(path, ((path, int(size), sha, obj), part.node_rank))
    _, sha256 = manifest_of([(f[0], f[1], f[2]) for f, _ in chosen.values()])
    ckpt = Checkpoint(
        owner_id=owner,
        job_id=lead.job_id,
        attempt=lead.attempt,
        name=lead.name,
        epoch=meta.get("epoch"),
        step=meta.get("step"),
        size_bytes=sum(f[1] for f, _ in chosen.values()),
        sha256=sha256,
        storage_key=folder_prefix(NodeKey(job_id=lead.job_id, attempt=lead.attempt, node_rank=0), lead.name),
        metrics=meta.get("metrics") or {},
        kind="folder",
        files=len(chosen),
    )
    record_checkpoint(session, ckpt)
    session.add_all(
        CheckpointFile(
            checkpoint_id=ckpt.id, path=f[0], size_bytes=f[1], sha256=f[2], node_rank=rank, storage_key=f[3]
        )
        for f, rank in chosen.values()
    )
    session.flush()
    return ckpt


def end_node(db: Database, storage: Storage, key: NodeKey) -> None:
    """After a node ended: once every node of its attempt has, the parts never listed go, with
    every object of theirs no listed checkpoint holds (and so do earlier attempts' leftovers).
    Housekeeping: it never fails the node (what it leaves, the next node's end takes)."""
    try:
        _end_node(db, storage, key)
    except Exception:
        log.exception(
            "job %s node %s: could not clean its unlisted checkpoint parts", key.job_id, key.node_rank
        )


def _end_node(db: Database, storage: Storage, key: NodeKey) -> None:
    with db.transaction() as session:
        states = jobs_repo.node_states(session, key.job_id, key.attempt)
        if any(state not in NODE_ENDED for state in states):
            return
        ids = repo.part_ids_up_to(session, key.job_id, key.attempt)
        repo.delete_looks_up_to(session, key.job_id, key.attempt)
    _drop_parts(db, storage, ids)


def _drop_parts(db: Database, storage: Storage, part_ids: Sequence[int]) -> None:
    """The parts' rows, then their objects that no listed checkpoint holds."""
    if not part_ids:
        return
    with db.transaction() as session:
        rows = repo.parts_by_ids(session, part_ids)
        prefixes = [row.prefix for row in rows]
        for row in rows:
            session.delete(row)
    for prefix in prefixes:
        _delete_prefix(storage, prefix, db)


def _delete_prefix(storage: Storage, prefix: str, db: Database | None = None) -> None:
    try:
        keys = storage.list(prefix)
        if db is not None and keys:
            keys = unreferenced(db, keys)
        for obj in keys:
            storage.delete(obj)
    except Exception:  # housekeeping: a stray object is wasted space, never a wrong listing
        log.exception("could not delete the objects under %s", prefix)


def unreferenced(db: Database, keys: Sequence[str]) -> list[str]:
    with db.read() as session:
        return unreferenced_in(session, keys)


def resume_layout(db: Database, ckpt_id: int) -> tuple[str, str, list[StoredFile]] | None:
    """(name, kind, files) of the checkpoint a node resumes from: a folder's every file with its
    storage key, for staging (contract §11); None when it is gone."""
    with db.read() as session:
        ckpt = repo.by_id(session, ckpt_id)
        if ckpt is None:
            return None
        if ckpt.kind != "folder":
            return ckpt.name, ckpt.kind, []
        rows = repo.files_of(session, ckpt_id)
        files = [(f.path, f.size_bytes, f.sha256, f.storage_key) for f in rows]
    return ckpt.name, "folder", files
