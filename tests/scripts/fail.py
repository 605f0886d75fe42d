"""A rank that prints a little, then fails with exit code 3 after saying why on stderr."""

import sys

print("starting up", flush=True)
print("loading data", flush=True)
print("something went wrong: the answer was not 42", file=sys.stderr, flush=True)
sys.exit(3)
