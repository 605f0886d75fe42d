"""A torchrun-ready script whose one checkpoint only a full unpickle could load.

    unsafe_checkpoint.py MARKER

Besides an ordinary state dict, the file holds an object whose unpickling calls
`open(MARKER, "w")`: `torch.load(weights_only=True)` refuses it before anything runs, and if
anything ever loaded it fully, MARKER would appear.
"""

import os
import sys

import torch


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def main():
    if int(os.environ.get("RANK", "0")) != 0:
        return
    path = os.path.join(os.environ["TORCHJOBS_CHECKPOINT_DIR"], "epoch-0001.pt")
    obj = {"state_dict": {"net": {"w": torch.zeros(4)}}, "epoch": 1, "step": 1, "extra": Payload(sys.argv[1])}
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
