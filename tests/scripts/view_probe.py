"""Prints what a rank sees of its machine, one `view.KEY=VALUE` a line (test_sandbox.py)."""

import os
import sys


def writable(folder: str) -> bool:
    probe = os.path.join(folder, ".view-probe")
    try:
        with open(probe, "w") as fh:
            fh.write("x")
        os.unlink(probe)
        return True
    except OSError:
        return False


print(f"view.uid={os.getuid()}")
print(f"view.cwd={os.getcwd()}")
print(f"view.home={os.environ.get('HOME')}")
print(f"view.tmpdir={os.environ.get('TMPDIR')}")
print(f"view.home_writable={writable(os.environ['HOME'])}")
print(f"view.prefix_writable={writable(sys.prefix)}")
print(f"view.processes={sum(1 for e in os.listdir('/proc') if e.isdigit())}")
print(f"view.env={','.join(sorted(os.environ))}")
