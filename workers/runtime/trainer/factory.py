"""Turn an entrypoint into a model and datasets: builtin names or "module:callable" factories.

A factory failure names the string the user wrote and the step that failed (import, attribute,
call, result type), since that string is all they control.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from workers.runtime.errors import FactoryError
from workers.runtime.trainer.config import Entrypoint, Hyperparameters
from workers.runtime.trainer.data import builtin_datasets
from workers.runtime.trainer.models import BUILTIN_MODELS


def resolve_callable(spec: str, *, role: str) -> Callable[[], Any]:
    """Import "package.module:attr.path" and return the callable it names."""
    module_name, _, attr_path = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise FactoryError(f"{role} factory {spec!r}: cannot import {module_name!r}: {exc!r}") from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise FactoryError(
                f"{role} factory {spec!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(obj):
        raise FactoryError(f"{role} factory {spec!r} is not callable (it is a {type(obj).__name__})")
    return obj


def _call(spec: str, role: str) -> Any:
    factory = resolve_callable(spec, role=role)
    try:
        return factory()
    except Exception as exc:
        raise FactoryError(f"{role} factory {spec!r} raised {exc!r}") from exc


def load_model(entry: Entrypoint) -> nn.Module:
    """A fresh model; factories are called with no arguments and must return an nn.Module."""
    if entry.kind == "builtin":
        return BUILTIN_MODELS[entry.model]()
    model = _call(entry.model, "model")
    if not isinstance(model, nn.Module):
        raise FactoryError(f"model factory {entry.model!r} returned {type(model).__name__}, not an nn.Module")
    return model


def load_datasets(entry: Entrypoint, hp: Hyperparameters) -> tuple[Dataset, Dataset | None]:
    """(train, validation-or-None). A factory returns (train, val), (train, None) or just train."""
    if entry.kind == "builtin":
        return builtin_datasets(entry.dataset, synthetic_size=hp.synthetic_size)
    result = _call(entry.dataset, "dataset")
    train, val = result if isinstance(result, tuple | list) and len(result) == 2 else (result, None)
    for name, ds in (("train", train), ("validation", val)):
        if ds is not None and not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise FactoryError(
                f"dataset factory {entry.dataset!r}: the {name} dataset ({type(ds).__name__}) "
                "is not a map-style dataset (it needs __getitem__ and __len__)"
            )
    return train, val
