"""A rank that ignores SIGTERM (contract §12: it loses what it did not checkpoint, and is
killed `stop_grace_s` after the stop). Prints a line every 0.2 s, forever. No torch import."""

import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
while True:
    print("still here", flush=True)
    time.sleep(0.2)
