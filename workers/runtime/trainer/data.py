"""Builtin datasets and the loaders: a data order that depends only on (seed, epoch).

Every mode draws its order from `DistributedSampler` (one replica in single and dp), which
shuffles with a generator seeded `seed + epoch`. Epoch e's order therefore never depends on what
ran before, which is what lets a resumed job see exactly the batches the uninterrupted job would
have; a mid-epoch resume skips the batches already trained on.

Random augmentation in a dataset's `__getitem__` follows the same rule. With `num_workers: 0` it
draws from the rank's own generators (seeded `seed + rank`, saved in the checkpoint). Loader
workers are other processes, whose streams a checkpoint cannot hold, and which DataLoader seeds
from one generator: with the same seed on every rank, worker k applied the same augmentation on
every rank, and (persistent workers) resumed streams restarted where epoch 1's began. So each
batch a worker fetches is drawn with torch, `random` and numpy seeded from (seed, rank, epoch,
batch): different on every rank and in every epoch, and the same after a resume, mid-epoch too,
whichever worker fetches it and however many there are.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import itertools
import random
import signal
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from workers.runtime.trainer.loader_workers import worker_context

NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)
DIGITS_SPLIT_SEED = 0  # the train/validation split never changes with the job's seed
DIGITS_VAL_FRACTION = 0.2
SYNTHETIC_SEED = 1234
SYNTHETIC_VAL_FRACTION = 0.2


@functools.lru_cache(maxsize=1)
def digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits as (x_train, y_train, x_val, y_val), pixels in [0, 1].

    Cached: reading and splitting the bundled CSV costs more than an epoch of training.
    """
    table = digits_table()
    x = torch.from_numpy((table[:, :-1] / 16.0).astype(np.float32)).reshape(-1, *IMAGE_SHAPE)
    y = torch.from_numpy(table[:, -1].astype(np.int64))
    order = torch.from_numpy(np.random.RandomState(DIGITS_SPLIT_SEED).permutation(len(y)))
    n_val = int(round(len(y) * DIGITS_VAL_FRACTION))
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]


def digits_table() -> np.ndarray:
    """The rows of scikit-learn's `digits.csv.gz` (64 pixels, then the label), read as its
    `load_digits` reads them, without importing scikit-learn: `sklearn.datasets` costs a rank
    1.5-1.9 s of CPU (scipy, its validators) against 0.03 s for the file, on every rank of every
    digits job and in every warm spare. `find_spec` locates the package without running it, and
    finds a job's own scikit-learn first when its environment has one, as the import did. Where
    the file is not in a folder of the package (an editable install's loader), `load_digits`."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ModuleNotFoundError("the digits dataset ships with scikit-learn: install it", name="sklearn")
    folders = [*(spec.submodule_search_locations or ()), *([Path(spec.origin).parent] if spec.origin else [])]
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt", encoding="utf-8") as rows:
                return np.loadtxt(rows, delimiter=",")
    from sklearn.datasets import load_digits  # the slow way, where the file is not laid out so

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


@functools.lru_cache(maxsize=4)
def synthetic_tensors(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`size` training and size/5 validation images in [0, 1], labelled by a fixed random linear
    teacher so that there is something to learn; the same for every rank and every run."""
    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    n_val = max(1, int(size * SYNTHETIC_VAL_FRACTION))
    x = torch.rand(size + n_val, *IMAGE_SHAPE, generator=gen)
    teacher = torch.randn(x[0].numel(), NUM_CLASSES, generator=gen)
    y = ((x.flatten(1) - 0.5) @ teacher).argmax(dim=1)
    return x[:size], y[:size], x[size:], y[size:]


def builtin_datasets(name: str, *, synthetic_size: int) -> tuple[Dataset, Dataset]:
    """(train, validation) of a builtin dataset."""
    if name == "digits":
        x_tr, y_tr, x_va, y_va = digits_tensors()
    elif name == "synthetic":
        x_tr, y_tr, x_va, y_va = synthetic_tensors(synthetic_size)
    else:
        raise ValueError(f"unknown builtin dataset {name!r}")
    return TensorDataset(x_tr, y_tr), TensorDataset(x_va, y_va)


def stream_seed(*key: int) -> int:
    """A 64-bit seed for the random stream named by `key` (seed, rank, epoch, batch, ...): keys
    that differ anywhere give unrelated streams, which `seed + rank + epoch` would not."""
    return int(np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0])


class SeededBatch(list[int]):
    """A batch's sample indices plus its place, (epoch, batch number in the epoch), from which a
    loader worker seeds the batch's augmentation (see `PerBatchSeeds`). Picklable, so it reaches
    the worker through the DataLoader's index queue with its place."""

    def __init__(self, indices: list[int], place: tuple[int, int]) -> None:
        super().__init__(indices)
        self.place = place


class EpochBatchSampler(BatchSampler):
    """Full batches of this rank's shard in epoch order, optionally skipping the first few.

    `set_epoch` must be called before each epoch (it also drops any skip left from a resume).
    With `record`, keeps the batches handed out this epoch for the debug dump.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        num_replicas: int,
        rank: int,
        seed: int,
        record: bool = False,
    ) -> None:
        sampler: DistributedSampler[int] = DistributedSampler(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        super().__init__(sampler, batch_size, drop_last=True)
        self._epoch = 0
        self._skip = 0
        self._record = record
        self.handed_out: list[list[int]] = []

    @property
    def batches_per_epoch(self) -> int:
        return super().__len__()

    def set_epoch(self, epoch: int, *, skip_batches: int = 0) -> None:
        if not 0 <= skip_batches <= self.batches_per_epoch:
            raise ValueError(f"cannot skip {skip_batches} of {self.batches_per_epoch} batches")
        cast(DistributedSampler[int], self.sampler).set_epoch(epoch)
        self._epoch = epoch
        self._skip = skip_batches
        self.handed_out = []

    def __iter__(self) -> Iterator[list[int]]:
        batches = itertools.islice(super().__iter__(), self._skip, None)
        for number, indices in enumerate(batches, start=self._skip):
            batch = SeededBatch(indices, (self._epoch, number))
            if self._record:
                self.handed_out.append(batch)
            yield batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self._skip


def _ignore_sigterm(_worker_id: int) -> None:
    """The platform stops a job with SIGTERM to the whole process group. A loader worker that
    died of it would make the rank's next fetch fail before it could finish its step and save;
    workers instead exit when their rank shuts the loader down (or notices it is gone)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    num_workers: int
    pin_memory: bool
    seed: int
    rank: int = 0

    def generator(self) -> torch.Generator:
        """The loader's own generator (its workers' base seed), distinct per rank."""
        return torch.Generator().manual_seed(stream_seed(self.seed, self.rank) & (2**63 - 1))


class PerBatchSeeds(Dataset):
    """A map-style dataset whose batches, fetched in a loader worker, draw their randomness from
    generators seeded by the batch's place (see the module docstring). In the rank's own process
    (`num_workers: 0`) it only fetches: the rank's generators are already its own and resumed."""

    def __init__(self, dataset: Dataset, *, seed: int, rank: int) -> None:
        self.dataset, self.seed, self.rank = dataset, seed, rank

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Any:
        place = getattr(indices, "place", None)
        if place is not None and torch.utils.data.get_worker_info() is not None:
            _seed_this_process(stream_seed(self.seed, self.rank, *place))
        inner = getattr(self.dataset, "__getitems__", None)
        if inner is not None:
            return inner(list(indices))
        return [self.dataset[i] for i in indices]


def _seed_this_process(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


class BatchedTensorDataset(TensorDataset):
    """A TensorDataset that hands the DataLoader a whole batch in one indexing operation.

    The DataLoader's fetcher calls `__getitems__` with every index of a batch when a dataset
    has it; without it, a batch costs one `__getitem__` per sample plus a `torch.stack` per
    field in `default_collate`. For in-memory tensors (the builtin data sets) one gather per
    field gives the same tensors at a fraction of the per-step cost.
    """

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t[index] for t in self.tensors)


def _already_batched(batch: Any) -> Any:
    return batch


def train_loader(dataset: Dataset, batch_sampler: EpochBatchSampler, opts: LoaderOptions) -> DataLoader:
    """The training loader; its own generator keeps loader bookkeeping off the global RNG.
    Plain in-memory tensor data sets (no `__getitem__` of their own, so nothing random) are
    gathered a batch at a time (BatchedTensorDataset); any other data set is fetched through
    `PerBatchSeeds`."""
    batched = type(dataset) is TensorDataset
    if batched:
        dataset = BatchedTensorDataset(*cast(TensorDataset, dataset).tensors)
    else:
        dataset = PerBatchSeeds(dataset, seed=opts.seed, rank=opts.rank)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=_already_batched if batched else None,
        num_workers=opts.num_workers,
        pin_memory=opts.pin_memory,
        persistent_workers=opts.num_workers > 0,
        worker_init_fn=_ignore_sigterm,
        multiprocessing_context=worker_context(dataset, opts.num_workers, opts.rank),
        generator=opts.generator(),
    )


def val_loader(
    dataset: Dataset, *, batch_size: int, rank: int, world_size: int, opts: LoaderOptions
) -> DataLoader:
    """Validation on every rank over a strided shard (no padding, so summed counts are exact)."""
    shard = Subset(dataset, range(rank, len(cast(Sized, dataset)), world_size))
    return DataLoader(
        shard,
        batch_size=batch_size,
        shuffle=False,
        num_workers=opts.num_workers,
        pin_memory=opts.pin_memory,
        persistent_workers=opts.num_workers > 0,
        worker_init_fn=_ignore_sigterm,
        multiprocessing_context=worker_context(shard, opts.num_workers, opts.rank),
        generator=opts.generator(),
    )
