"""Reports COUNT progress lines to TORCHJOBS_EVENTS, INTERVAL seconds apart, and prints a line
each time; exits with EXIT_CODE. No torch import: it starts fast.

    progress.py [COUNT=20] [INTERVAL=0.05] [EXIT_CODE=0]

Each report carries `t_write` (the writer's clock), which the benchmark uses for event lag.
"""

import json
import os
import sys
import time

count = int(sys.argv[1]) if len(sys.argv) > 1 else 20
interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
exit_code = int(sys.argv[3]) if len(sys.argv) > 3 else 0
rank = int(os.environ.get("RANK", "0"))
events = os.environ["TORCHJOBS_EVENTS"]
epochs = 2

for i in range(1, count + 1):
    if rank == 0:
        report = {
            "type": "progress",
            "t_write": time.time(),
            "epoch": (i * epochs) // count,
            "epochs": epochs,
            "step": i,
            "total_steps": count,
            "loss": round(1.0 / i, 6),
            "samples_per_sec": 1000.0 + i,
            "val_accuracy": round(i / count, 6),
        }
        fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(report) + "\n").encode())
        finally:
            os.close(fd)
    print(f"rank {rank} step {i}/{count}", flush=True)
    if interval > 0:
        time.sleep(interval)
sys.exit(exit_code)
