"""The known matrix product a GPU must compute in the pre-flight (gpu_check.py runs it)."""

from __future__ import annotations

import torch


def known_factor() -> torch.Tensor:
    return torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) / 4096


def product_on(index: int) -> torch.Tensor:
    device = torch.device("cuda", index)
    a = known_factor().to(device)
    product = (a @ a).cpu()  # .cpu() waits for the kernel: its errors surface here
    torch.cuda.synchronize(device)
    return product


def check_product(product: torch.Tensor, index: int) -> None:
    a = known_factor()
    if not torch.allclose(product, a @ a, rtol=1e-3, atol=1e-3):
        raise RuntimeError(f"GPU {index} computed a wrong matrix product")
