"""A job's own process lying in wait for the next exec'd process of its uid (contract §14's
walls): it attaches with ptrace as early as it can and says what filter the process had then.
An exec'd process the job could catch unfiltered could be made to exec anything unfiltered."""

import ctypes
import os
import sys
import time

PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
uid, me, seen = os.getuid(), os.getpid(), set()
deadline = time.monotonic() + float(sys.argv[1])
print("watching", flush=True)
while time.monotonic() < deadline:
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in seen or int(entry) == me:
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if b"torchjobs exec" not in cmdline:
            continue
        seen.add(pid)
        if libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
            print("refused", os.strerror(ctypes.get_errno()), flush=True)
            continue
        try:
            with open(f"/proc/{pid}/status") as fh:
                status = fh.read()
        except OSError:
            status = ""
        filters = [line.split()[1] for line in status.splitlines() if line.startswith("Seccomp:")]
        print("seized seccomp", filters[0] if filters else "?", flush=True)
        libc.ptrace(PTRACE_DETACH, pid, None, None)
        sys.exit(0)
    time.sleep(0.0005)
print("nothing seized", flush=True)
