"""A torchrun-ready script that reports what it resumed from and writes real checkpoints.

    resume_probe.py [--count K] [--mib M]

It loads TORCHJOBS_RESUME_FROM (if set) with weights_only=True, reports the saved epoch and the
file's SHA-256 as a progress event, then writes K checkpoints of about M MiB each (epochs
continuing from the saved one) into TORCHJOBS_CHECKPOINT_DIR atomically, reporting each file's
SHA-256, so a test can compare what the rank wrote with what the API serves.
"""

import argparse
import hashlib
import json
import os

import torch


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def emit(event):
    with open(os.environ["TORCHJOBS_EVENTS"], "a") as fh:
        fh.write(json.dumps(event) + "\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--mib", type=float, default=1.0)
    args = parser.parse_args()

    resume = os.environ.get("TORCHJOBS_RESUME_FROM")
    start_epoch, resumed_sha = 0, ""
    if resume:
        raw = torch.load(resume, map_location="cpu", weights_only=True)
        if isinstance(raw, dict) and "state_dict" in raw:
            start_epoch = int(raw.get("epoch", 0))
        resumed_sha = sha256(resume)
    print(f"resume_from={resume} epoch={start_epoch} sha256={resumed_sha}", flush=True)
    emit(
        {
            "type": "progress",
            "epoch": start_epoch,
            "epochs": start_epoch + args.count,
            "step": start_epoch * 10,
            "resumed_epoch": start_epoch,
            "resumed_sha256": resumed_sha,
        }
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return
    folder = os.environ["TORCHJOBS_CHECKPOINT_DIR"]
    for i in range(1, args.count + 1):
        epoch = start_epoch + i
        name = f"epoch-{epoch:04d}.pt"
        weights = torch.rand(
            int(args.mib * (1 << 20) / 4) + 37, generator=torch.Generator().manual_seed(epoch)
        )
        obj = {
            "state_dict": {"net": {"w": weights}},
            "epoch": epoch,
            "step": epoch * 10,
            "meta": {"resumed_epoch": start_epoch, "resumed_sha256": resumed_sha},
        }
        path = os.path.join(folder, name)
        emit({"type": "checkpoint", "file": name, "epoch": epoch, "step": epoch * 10})
        torch.save(obj, path + ".tmp")
        os.replace(path + ".tmp", path)
        emit(
            {
                "type": "progress",
                "epoch": epoch,
                "step": epoch * 10,
                "ckpt_file": name,
                "ckpt_sha256": sha256(path),
            }
        )


if __name__ == "__main__":
    main()
