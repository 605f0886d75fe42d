import json
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
r = dist.get_rank()
print(f"hello from rank {r} of {dist.get_world_size()} job {os.environ['TORCHJOBS_JOB_ID']}", flush=True)
with open(os.environ["TORCHJOBS_EVENTS"], "a") as f:
    f.write(
        json.dumps({"type": "progress", "epoch": 1, "epochs": 1, "step": 1, "total_steps": 1, "loss": 0.5})
        + "\n"
    )
if r == 0:
    p = os.path.join(os.environ["TORCHJOBS_CHECKPOINT_DIR"], "epoch-0001.pt")
    import torch

    torch.save({"state_dict": {"net": {"w": torch.ones(2)}}, "epoch": 1, "step": 1}, p + ".tmp")
    os.replace(p + ".tmp", p)
dist.barrier()
dist.destroy_process_group()
if len(sys.argv) > 1:
    print("boom on stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
