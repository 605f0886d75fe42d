"""`python -m workers.runtime.gpu_check all|INDEX`: the pre-flight's GPU check, in a process of
its own.

Run in the rank's own interpreter, the check would initialise CUDA there before the job's code
starts. A script that then sets `CUDA_VISIBLE_DEVICES` itself (to pick a card, or to hide them
from a tool it forks) would find it ignored, since CUDA reads it once per process, and a script
that forks CUDA subprocesses after a CUDA init gets "Cannot re-initialize CUDA in forked
subprocess". Under bare torchrun neither happens, so the check runs here, in a child that
inherits the rank's environment and exits: 0 when every GPU computed the known product (or no
CUDA device is there: the trainer's own plan says so better), else 1 with one line on stdout
naming the GPU and the error.
"""

from __future__ import annotations

import sys

import torch

from workers.runtime.preflight_product import check_product, product_on


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (argv[0] == "all" or argv[0].isdigit()):
        print("usage: python -m workers.runtime.gpu_check all|INDEX", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        return 0
    devices = range(torch.cuda.device_count()) if argv[0] == "all" else [int(argv[0])]
    for index in devices:
        try:
            check_product(product_on(index), index)
        except (RuntimeError, OSError) as exc:  # CUDA errors are RuntimeErrors
            text = (str(exc).strip() or type(exc).__name__).splitlines()[0][:400]
            print(f"GPU {index}: {text}", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
