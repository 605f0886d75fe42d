"""Random augmentation in DataLoader workers: different on every rank and in every epoch, and
the same after a resume (see workers/runtime/trainer/data.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from workers.runtime.trainer.data import EpochBatchSampler, LoaderOptions, train_loader

SEED = 3


class Noise(Dataset):
    """An augmentation and nothing else: each sample is fresh torch noise, so a batch shows
    exactly what its worker's generator drew."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.rand(3), index


def _loader(rank: int, workers: int = 2) -> tuple[EpochBatchSampler, Any]:
    dataset = Noise()
    sampler = EpochBatchSampler(dataset, batch_size=4, num_replicas=2, rank=rank, seed=SEED)
    opts = LoaderOptions(num_workers=workers, pin_memory=False, seed=SEED, rank=rank)
    return sampler, train_loader(dataset, sampler, opts)


def _epoch(sampler: EpochBatchSampler, loader: Any, epoch: int, skip: int = 0) -> list[torch.Tensor]:
    sampler.set_epoch(epoch, skip_batches=skip)
    return [x for x, _ in loader]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_two_ranks_draw_different_augmentations() -> None:
    rank0, rank1 = (_epoch(*_loader(rank), epoch=0) for rank in (0, 1))
    assert len(rank0) == len(rank1) == 8
    for a, b in zip(rank0, rank1, strict=True):
        assert not torch.isclose(a, b).any()  # before: worker k drew the same noise on every rank


def test_a_resumed_loader_draws_what_the_uninterrupted_one_draws() -> None:
    """Persistent workers carry their streams from epoch to epoch; a resumed job starts new
    workers. Both must draw the same: at an epoch boundary and in the middle of an epoch."""
    sampler, loader = _loader(rank=1)
    first, second = _epoch(sampler, loader, 0), _epoch(sampler, loader, 1)
    assert not any(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert _same(_epoch(*_loader(rank=1), epoch=1), second)
    assert _same(_epoch(*_loader(rank=1), epoch=1, skip=3), second[3:])
    assert _same(_epoch(*_loader(rank=1, workers=1), epoch=1), second)  # whatever the worker count


class JitteredTensors(TensorDataset):
    """A TensorDataset subclass that augments in its own __getitem__."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y = super().__getitem__(index)
        return x + torch.rand_like(x), y


def test_a_tensor_dataset_subclass_keeps_its_own_getitem() -> None:
    """Plain TensorDatasets are gathered a batch at a time, which bypasses `__getitem__`; a
    subclass's augmentation must not be bypassed with it."""
    dataset = JitteredTensors(torch.zeros(16, 2), torch.arange(16))
    sampler = EpochBatchSampler(dataset, batch_size=4, num_replicas=1, rank=0, seed=SEED)
    loader = train_loader(dataset, sampler, LoaderOptions(num_workers=0, pin_memory=False, seed=SEED))
    sampler.set_epoch(0)
    assert all((x != 0).all() for x, _ in loader)


JITTER_FACTORY = """
import torch
from torch.utils.data import Dataset
from workers.runtime.trainer.data import builtin_datasets

class Jitter(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        x, y = self.base[index]
        return x + 0.1 * torch.randn_like(x), y

def data():
    train, val = builtin_datasets("synthetic", synthetic_size=256)
    return Jitter(train), val
"""


def test_two_epochs_with_augmenting_workers_equal_one_resume_one_bitwise(jobs: Any, tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "jitter.py").write_text(JITTER_FACTORY)

    def start(name: str, epochs: int, resume: Path | None = None) -> Any:
        config = jobs.config("single", epochs=epochs, num_workers=2)
        config["entrypoint"] = {
            "kind": "factory",
            "model": "workers.runtime.trainer.models:build_cnn",
            "dataset": "jitter:data",
        }
        return jobs.start(
            tmp_path / name, config, resume=resume, torchrun=False, PYTHONPATH=str(tmp_path / "pkg")
        )

    straight, short = start("straight", 2), start("short", 1)
    straight.ok(), short.ok()
    resumed = start("resumed", 2, resume=short.checkpoints / "epoch-0001.pt").ok()
    jobs.assert_same_weights(jobs.final_weights(straight), jobs.final_weights(resumed))
