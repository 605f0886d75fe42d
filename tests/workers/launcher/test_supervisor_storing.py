"""The supervisor against a database that goes away and a look at the job that rides on the
batch: a node keeps training while its writes fail, keeps what it could not store, and asks
the database about the job only when no batch told it already. The hooks are plain functions
here; the real database outage is tests/integration/test_failures.py."""

from __future__ import annotations

import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from service.nodes.values import Batch, JobControl, NodeKey
from workers.launcher import supervisor as supervisor_module
from workers.launcher.command import LaunchPlan, NodePaths
from workers.launcher.ingest import EventsTail
from workers.launcher.jobfiles import JobFolder
from workers.launcher.supervisor import EVENT_GAP_S, FolderHooks, Hooks, NodeSupervisor

# A stand-in for torchrun: a progress line every 50 ms in the events file, one checkpoint file
# per "epoch" (written, then renamed into place), for `seconds`, then exit 0.
FAKE_TRAINING = """
import json, os, sys, time
events, ckpts, seconds, epochs = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
os.makedirs(ckpts, exist_ok=True)
end, step = time.monotonic() + seconds, 0
with open(events, "a") as fh:
    while time.monotonic() < end:
        step += 1
        fh.write(json.dumps({"type": "progress", "step": step}) + "\\n")
        fh.flush()
        time.sleep(0.05)
for epoch in range(1, epochs + 1):
    with open(os.path.join(ckpts, f"epoch-{epoch}.pt.tmp"), "wb") as out:
        out.write(b"x" * epoch)
    os.rename(os.path.join(ckpts, f"epoch-{epoch}.pt.tmp"), os.path.join(ckpts, f"epoch-{epoch}.pt"))
"""


def supervisor(tmp_path: Path, hooks: Hooks, seconds: float, epochs: int = 0) -> NodeSupervisor:
    paths = NodePaths(run_dir=tmp_path / "node")
    argv = [sys.executable, "-c", FAKE_TRAINING, str(paths.events), str(paths.checkpoints), str(seconds)]
    return node(paths, [*argv, str(epochs)], hooks)


def node(paths: NodePaths, argv: list[str], hooks: Hooks) -> NodeSupervisor:
    plan = LaunchPlan(argv=argv, env={}, cwd=paths.run_dir.parent, paths=paths, config=None)
    return NodeSupervisor(
        key=NodeKey(job_id=1, attempt=1, node_rank=0),
        plan=plan,
        mode="single",
        gpus=1,
        hooks=hooks,
        grace_s=1,
        shutdown=threading.Event(),
    )


class Recorder:
    """Hooks that fail their first `fail` calls each, then store."""

    def __init__(self, fail: int = 0, control: JobControl | None = ("running", 1)) -> None:
        self.fail = {"batch": fail, "control": fail, "checkpoint": fail}
        self.control_state = control
        self.steps: list[int] = []
        self.checkpoints: list[str] = []
        self.control_looks = 0

    def _maybe_fail(self, what: str) -> None:
        if self.fail[what]:
            self.fail[what] -= 1
            raise ConnectionError(f"{what}: the database is away")

    def write_batch(self, batch: Batch) -> JobControl | None:
        self._maybe_fail("batch")
        self.steps += [e["step"] for e in batch.events]
        return self.control_state if batch else None

    def job_control(self) -> JobControl | None:
        self.control_looks += 1
        self._maybe_fail("control")
        return ("running", 1)

    def record_checkpoint(self, file: Any, name: str, meta: dict[str, Any] | None, version: int) -> None:
        self._maybe_fail("checkpoint")
        file.read()  # storing reads the whole file; a retry starts again from its start
        self.checkpoints.append(name)

    def hooks(self) -> Hooks:
        return Hooks(
            write_batch=self.write_batch,
            record_checkpoint=self.record_checkpoint,
            job_control=self.job_control,
        )


def test_a_node_trains_on_while_the_database_is_away_and_loses_nothing(tmp_path: Path) -> None:
    rec = Recorder(fail=4)  # two seconds of failed batches, four failed looks at the job
    rec.control_state = None  # no batch tells the state: every look goes to the database
    outcome = supervisor(tmp_path, rec.hooks(), seconds=3.0, epochs=3).run()
    assert outcome.state == "succeeded"
    assert rec.fail == {"batch": 0, "control": 0, "checkpoint": 0}  # it did meet every refusal
    assert rec.steps == list(range(1, len(rec.steps) + 1)) and len(rec.steps) > 20
    assert rec.checkpoints == ["epoch-1.pt", "epoch-2.pt", "epoch-3.pt"]


def test_a_checkpoint_refused_at_the_end_is_recorded_once_storing_works(tmp_path: Path) -> None:
    rec = Recorder()
    rec.fail["checkpoint"] = 2
    outcome = supervisor(tmp_path, rec.hooks(), seconds=0.2, epochs=2).run()
    assert outcome.state == "succeeded"
    assert rec.checkpoints == ["epoch-1.pt", "epoch-2.pt"]


def test_the_look_at_the_job_rides_on_the_batch(tmp_path: Path) -> None:
    rec = Recorder()
    outcome = supervisor(tmp_path, rec.hooks(), seconds=3.0).run()
    assert outcome.state == "succeeded" and len(rec.steps) > 20
    # Some 3 looks at the job; only the first, before the process had written, asked for it.
    assert rec.control_looks <= 1


def test_reports_go_out_soon_and_a_busy_node_still_batches_them(tmp_path: Path) -> None:
    """A report does not wait for the next half-second batch, yet a node that reports every
    50 ms commits at most once per EVENT_GAP_S (plus the final drain), every step in order."""
    rec = Recorder()
    batches: list[int] = []
    write = rec.write_batch

    def counted(batch: Batch) -> JobControl | None:
        if batch.events:
            batches.append(len(batch.events))
        return write(batch)

    hooks = rec.hooks()
    hooks.write_batch = counted
    seconds = 2.0
    assert supervisor(tmp_path, hooks, seconds=seconds).run().state == "succeeded"
    assert rec.steps == list(range(1, len(rec.steps) + 1)) and len(rec.steps) > 20
    assert len(batches) <= seconds / EVENT_GAP_S + 2, batches


def test_the_events_file_says_when_it_has_news(tmp_path: Path) -> None:
    tail = EventsTail(JobFolder(tmp_path), "events.jsonl")
    assert not tail.waiting()  # no file yet
    (tmp_path / "events.jsonl").write_text('{"type": "progress", "step": 1}\n')
    assert tail.waiting()
    assert tail.read_new() == [{"type": "progress", "step": 1}]
    assert not tail.waiting()


def test_a_cancel_seen_by_a_batch_stops_the_node(tmp_path: Path) -> None:
    rec = Recorder(control=("cancelling", 1))
    outcome = supervisor(tmp_path, rec.hooks(), seconds=60.0).run()
    assert outcome.state == "cancelled"
    assert rec.control_looks <= 1


# Output past what the supervisor holds while storing fails (MAX_PENDING_BYTES, 64 MiB).
FLOOD = """
import os, sys
rank_dir = os.path.join(sys.argv[1], "run", "attempt_0", "0")
os.makedirs(rank_dir)
open(os.path.join(rank_dir, "stderr.log"), "wb").close()
with open(os.path.join(rank_dir, "stdout.log"), "wb") as out:
    line = b"z" * 1023 + b"\\n"
    for _ in range(72 * 1024):  # 72 MiB
        out.write(line)
import time
time.sleep(float(sys.argv[2]))
"""


def test_a_backlog_is_not_hurried_while_storing_fails(tmp_path: Path) -> None:
    """With more output waiting than one look takes, the supervisor looks again at once; while
    the database refuses, it must wait its half second instead of retrying in a tight loop."""
    paths = NodePaths(run_dir=tmp_path / "node")
    argv = [sys.executable, "-c", FLOOD, str(paths.logs), "3"]
    tries = {"failed": 0}
    stored: list[int] = []
    refuse_until = time.monotonic() + 2.5

    def write_batch(batch: Batch) -> JobControl | None:
        if time.monotonic() < refuse_until:
            tries["failed"] += 1
            raise ConnectionError("the database is away")
        stored.extend(len(data) for _, _, data in batch.logs)
        return ("running", 1)

    hooks = Hooks(
        write_batch=write_batch, record_checkpoint=lambda *_: None, job_control=lambda: ("running", 1)
    )
    assert node(paths, argv, hooks).run().state == "succeeded"
    assert sum(stored) == 72 * 1024 * 1024  # nothing lost
    # About one try per half second over 2.5 s, plus the first backlog's quick looks.
    assert tries["failed"] <= 25, tries


# A stand-in for node 0 of a job whose ranks saved one DCP folder: shard and .metadata, then exit.
DCP_FOLDER = """
import os, sys
folder = os.path.join(sys.argv[1], "epoch-0001")
os.makedirs(folder)
for name in ("__0_0.distcp", ".metadata"):
    with open(os.path.join(folder, name), "wb") as out:
        out.write(b"x" * 64)
"""


def folder_hooks(store_part: Any, try_list: Any) -> Hooks:
    """A running job whose peers have ended: only the folder hooks say anything."""
    return Hooks(
        write_batch=lambda batch: ("running", 1),
        record_checkpoint=lambda *_: None,
        job_control=lambda: ("running", 1),
        peers_ended=lambda: datetime.now(UTC),
        folders=FolderHooks(store_part=store_part, try_list=try_list),
    )


def test_node_0_lists_its_last_folder_though_a_try_fails_after_its_peers_ended(tmp_path: Path) -> None:
    """The other node has ended, the first try found its part not stored yet, and the next try
    met the database away: node 0 tries again before it reports its end (it once gave up, and
    the job ended with its last folder checkpoint never listed)."""
    paths = NodePaths(run_dir=tmp_path / "node")
    answers: list[str] = ["not ready", "away", "listed"]
    listed: list[int] = []

    def try_list(part: int, meta: dict[str, Any] | None) -> int | None:
        answer = answers.pop(0) if answers else "listed"
        if answer == "away":
            raise ConnectionError("the database is away")
        if answer == "listed":
            listed.append(part)
            return 7
        return None

    def store_part(name: str, version: int, files: Any, opener: Any) -> int:
        for sig in files:
            opener(sig).close()
        return 41

    hooks = folder_hooks(store_part, try_list)
    outcome = node(paths, [sys.executable, "-c", DCP_FOLDER, str(paths.checkpoints)], hooks).run()
    assert outcome.state == "succeeded"
    assert listed == [41] and not answers


def test_a_stop_a_batch_brings_is_acted_on_before_the_next_look_at_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep stops a child (contract §13) in the transaction that stores its report, and the
    batch's answer says so: the node stops then, not at its next look at the job. With that
    look a thousand seconds away, the node still stops long before its 30 s of training end."""
    monkeypatch.setattr(supervisor_module, "CONTROL_EVERY_S", 1000.0)
    rec = Recorder()
    stored = rec.write_batch

    def stop_after_ten(batch: Batch) -> JobControl | None:
        control = stored(batch)
        return JobControl("running", 1, stop="early_stop") if len(rec.steps) >= 10 else control

    hooks = rec.hooks()
    hooks.write_batch = stop_after_ten
    node = supervisor(tmp_path, hooks, seconds=30.0)
    outcome = node.run()
    assert node.stop_reason == "early_stop" and outcome.state == "succeeded"
    assert len(rec.steps) < 200  # 30 s of a step every 50 ms would be 600


TWO_DCP_FOLDERS = """
import os, sys
for epoch in ("epoch-0001", "epoch-0002"):
    folder = os.path.join(sys.argv[1], epoch)
    os.makedirs(folder)
    for name in ("__0_0.distcp", ".metadata"):
        with open(os.path.join(folder, name), "wb") as out:
            out.write(b"x" * 64)
"""


def _two_folders_node(tmp_path: Path, try_list: Any) -> str:
    """A node 0 whose ranks save two DCP folders; its parts are numbered 1, 2 as stored, and
    `try_list` answers for the other nodes. The node's end state."""
    paths = NodePaths(run_dir=tmp_path / "node")
    parts = iter(range(1, 10))

    def store_part(name: str, version: int, files: Any, opener: Any) -> int:
        for sig in files:
            opener(sig).close()
        return next(parts)

    hooks = folder_hooks(store_part, try_list)
    argv = [sys.executable, "-c", TWO_DCP_FOLDERS, str(paths.checkpoints)]
    return node(paths, argv, hooks).run().state


def test_a_folder_listed_before_a_failed_try_is_not_tried_again(tmp_path: Path) -> None:
    """Two folders awaiting: the first is listed, the second's try fails. The first is awaited
    no more (tried again, its part gone, it would never answer and be reported never whole)."""
    tries: list[int] = []

    def try_list(part: int, meta: dict[str, Any] | None) -> int | None:
        tries.append(part)
        if part == 2 and tries.count(2) == 1:
            raise ConnectionError("the database is away")
        return 100 + part

    assert _two_folders_node(tmp_path, try_list) == "succeeded"
    assert tries == [1, 2, 2]


def test_folders_are_listed_in_the_order_they_were_saved(tmp_path: Path) -> None:
    """Two folders awaiting, the first not whole yet (another node still stores its part) when
    the second is: the second waits for it. Listed first, the older save would have become the
    job's latest checkpoint once it was listed in turn (seen in CI on a 2-host fsdp job)."""
    first_ready = False
    listed: list[int] = []

    def try_list(part: int, meta: dict[str, Any] | None) -> int | None:
        nonlocal first_ready
        if part == 1 and not first_ready:
            first_ready = True  # ready at its next try
            return None
        listed.append(part)
        return 100 + part

    assert _two_folders_node(tmp_path, try_list) == "succeeded"
    assert listed == [1, 2]


def test_once_the_other_nodes_ended_a_folder_never_whole_holds_back_none_after_it(tmp_path: Path) -> None:
    """In order, but not behind one that cannot be listed any more: every other node has
    ended and the first folder is still not whole (a node failed before its last look), the
    second is. The second is listed; the first is said never whole."""
    listed: list[int] = []

    def try_list(part: int, meta: dict[str, Any] | None) -> int | None:
        if part == 1:
            return None
        listed.append(part)
        return 100 + part

    assert _two_folders_node(tmp_path, try_list) == "succeeded"
    assert listed == [2]
