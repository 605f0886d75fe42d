"""Builtin models for 1x8x8 images and 10 classes; both carry BatchNorm on purpose, so that every
mode exercises the synchronised-BatchNorm path."""

from __future__ import annotations

from torch import nn

from workers.runtime.trainer.data import IMAGE_SHAPE, NUM_CLASSES


def build_cnn() -> nn.Module:
    """Three 3x3 conv blocks with BatchNorm2d, one 2x2 pool, global average pooling, a linear head."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(IMAGE_SHAPE[0], 16),
        *block(16, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, NUM_CLASSES),
    )


def build_mlp() -> nn.Module:
    """Two hidden layers with BatchNorm1d."""
    inputs = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(inputs, 128, bias=False),
        nn.BatchNorm1d(128),
        nn.ReLU(inplace=True),
        nn.Linear(128, 64, bias=False),
        nn.BatchNorm1d(64),
        nn.ReLU(inplace=True),
        nn.Linear(64, NUM_CLASSES),
    )


BUILTIN_MODELS = {"cnn": build_cnn, "mlp": build_mlp}
