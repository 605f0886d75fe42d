"""Builtin datasets and the loaders: a data order that depends only on (seed, epoch).

Every mode draws its order from `DistributedSampler` (one replica in single and dp), which
shuffles with a generator seeded `seed + epoch`. Epoch e's order therefore never depends on what
ran before, which is what lets a resumed job see exactly the batches the uninterrupted job would
have; a mid-epoch resume skips the batches already trained on.
"""

from __future__ import annotations

import functools
import itertools
import signal
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

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
    from sklearn.datasets import load_digits  # heavy import, only for jobs that use digits

    bunch = load_digits()
    x = torch.from_numpy((bunch.data / 16.0).astype(np.float32)).reshape(-1, *IMAGE_SHAPE)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    order = torch.from_numpy(np.random.RandomState(DIGITS_SPLIT_SEED).permutation(len(y)))
    n_val = int(round(len(y) * DIGITS_VAL_FRACTION))
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]


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
        self._skip = skip_batches
        self.handed_out = []

    def __iter__(self) -> Iterator[list[int]]:
        for batch in itertools.islice(super().__iter__(), self._skip, None):
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
    In-memory tensor data sets are gathered a batch at a time (BatchedTensorDataset)."""
    batched = isinstance(dataset, TensorDataset)
    if isinstance(dataset, TensorDataset):
        dataset = BatchedTensorDataset(*dataset.tensors)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=_already_batched if batched else None,
        num_workers=opts.num_workers,
        pin_memory=opts.pin_memory,
        persistent_workers=opts.num_workers > 0,
        worker_init_fn=_ignore_sigterm,
        generator=torch.Generator().manual_seed(opts.seed),
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
        generator=torch.Generator().manual_seed(opts.seed),
    )
