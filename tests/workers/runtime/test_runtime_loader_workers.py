"""DataLoader workers start from a forkserver, not as forks of the threaded rank
(workers/runtime/trainer/loader_workers.py says why: CPython gh-112275 hung a job here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from workers.launcher.procs import parent_of
from workers.runtime.trainer import loader_workers
from workers.runtime.trainer.data import EpochBatchSampler, LoaderOptions, train_loader, val_loader

REPO = Path(__file__).resolve().parents[3]
RACE = Path(__file__).parent / "scripts" / "loader_fork_race.py"


class Squares(Dataset):
    """Not a TensorDataset: fetched through PerBatchSeeds, item by item."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(index * index)]), index % 3


class Unpicklable(Squares):
    def __init__(self) -> None:
        self.transform = lambda x: x  # a lambda: pickle refuses it


def _opts(workers: int) -> LoaderOptions:
    return LoaderOptions(num_workers=workers, pin_memory=False, seed=5, rank=0)


def _epoch(dataset: Dataset, workers: int) -> tuple[Any, list[torch.Tensor]]:
    sampler = EpochBatchSampler(dataset, batch_size=4, num_replicas=1, rank=0, seed=5)
    sampler.set_epoch(0)
    loader = train_loader(dataset, sampler, _opts(workers))
    return loader, [x for x, _ in loader]


def test_workers_are_not_forks_of_the_rank_and_give_the_same_batches() -> None:
    forkserved, batches = _epoch(Squares(), workers=2)
    pids = [w.pid for w in forkserved._iterator._workers]
    assert len(pids) == 2 and all(parent_of(pid) != os.getpid() for pid in pids)
    _, in_process = _epoch(Squares(), workers=0)
    assert len(batches) == 10 and all(torch.equal(a, b) for a, b in zip(batches, in_process, strict=True))
    tensors = TensorDataset(torch.arange(40.0).unsqueeze(1), torch.zeros(40, dtype=torch.long))
    shard = val_loader(tensors, batch_size=8, rank=1, world_size=2, opts=_opts(2))
    assert torch.cat([x for x, _ in shard]).flatten().tolist() == [float(i) for i in range(1, 40, 2)]
    assert shard.multiprocessing_context.get_start_method() == "forkserver"


def test_a_data_set_that_does_not_pickle_keeps_fork_and_the_log_says_why(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert loader_workers.why_not_picklable(Squares()) is None
    assert "lambda" in (loader_workers.why_not_picklable(Unpicklable()) or "")
    forked, batches = _epoch(Unpicklable(), workers=2)
    assert len(batches) == 10
    assert all(parent_of(w.pid) == os.getpid() for w in forked._iterator._workers)
    err = capfd.readouterr().err
    assert "[torchjobs rank 0] the data set does not pickle" in err and "gh-112275" in err


def test_a_big_in_memory_data_set_is_not_serialised_to_be_checked() -> None:
    class Counting(loader_workers._Discard):
        written = 0

        def write(self, b: Any) -> int:
            Counting.written += len(memoryview(b))
            return super().write(b)

    big = TensorDataset(torch.zeros(2_000_000), torch.zeros(2_000_000, dtype=torch.long))  # 24 MB
    loader_workers._SkipArrays(Counting(), protocol=5).dump(big)
    assert Counting.written < 10_000


def test_loader_workers_start_while_native_threads_enter_python() -> None:
    """100 loaders, 2 workers each, while 3 native threads keep entering Python. Forked from
    the rank (the start method before), 2 of 6 runs of 40 loaders hung here; from the forkserver
    none can, because nothing else runs in the process that forks."""
    try:
        done = subprocess.run(
            [sys.executable, str(RACE), "100"], cwd=REPO, capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as exc:
        last = (exc.stdout or b"").decode().strip().splitlines()[-1:] if exc.stdout else []
        pytest.fail(f"a loader worker hung (after {last or 'no loader'})")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "loader 100 ok"


RANK = """\
import os, sys, threading, time
from multiprocessing import forkserver
from workers.launcher.procs import parent_of
from workers.runtime.trainer import loader_workers
if __name__ == '__main__':
    if sys.argv[1] == 'threaded':
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    loader_workers.start_server(2)
    print(forkserver._forkserver._forkserver_pid, flush=True)
    sys.stdin.readline()
"""


@pytest.mark.parametrize("rank_threads", ["one thread", "threaded"])
def test_the_forkserver_outlives_sigterm_and_ends_with_the_rank(tmp_path: Path, rank_threads: str) -> None:
    """SIGTERM goes to the job's whole process group: the forkserver must not die of it (its
    workers would take that for their rank's death), and must not outlive the rank. A rank
    with one thread forks it (its command line is the rank's); one with another thread gets
    multiprocessing's fresh interpreter."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    rank = subprocess.Popen(
        [sys.executable, str(script), rank_threads],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank.stdout is not None and rank.stdin is not None
    server = int(rank.stdout.readline())
    assert parent_of(server) == rank.pid
    forked = Path(f"/proc/{server}/cmdline").read_text() == Path(f"/proc/{rank.pid}/cmdline").read_text()
    assert forked == (rank_threads == "one thread")
    if not forked:
        time.sleep(4)  # the fresh server has imported its preload (torch) and set its handlers
    os.kill(server, signal.SIGTERM)
    time.sleep(0.5)
    assert _state(server) not in ("Z", "gone")
    rank.stdin.write("\n")
    rank.stdin.close()
    rank.wait(timeout=30)
    deadline = time.monotonic() + 20
    while _state(server) not in ("Z", "gone") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(server) in ("Z", "gone")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
