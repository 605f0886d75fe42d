"""Random-number-generator state as tensors and plain numbers, so checkpoints stay loadable with
`torch.load(weights_only=True)` (numpy arrays and Python tuples of the raw states are not)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng(*, cuda: bool) -> dict[str, Any]:
    """This process's Python, numpy, torch and CUDA generator states.

    CUDA keeps one generator per device, and DataParallel's replica i draws (dropout, say) from
    device i's: so every visible device's state is saved (`cuda_all`), besides the current
    one's (`cuda`, what checkpoints held before, and the fallback on another device count).
    """
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python_version": int(py_version),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_gauss": py_gauss,
        "numpy_kind": str(np_kind),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
    }
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_all"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng`. CUDA state is restored only where this process has CUDA (a GPU
    checkpoint resumes on the CPU), every device's when the device count is the saved one, else
    the current device's."""
    random.setstate((state["python_version"], tuple(state["python_state"].tolist()), state["python_gauss"]))
    np.random.set_state(
        (
            state["numpy_kind"],
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    every = state.get("cuda_all")
    if isinstance(every, list | tuple) and len(every) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(list(every))
    elif "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
