"""Prints MEGABYTES of deterministic output to stdout as fast as it can, then a last line
right before it exits (no flush by exit handlers: it flushes, then `os._exit`).

    chatty.py [MEGABYTES=50]

`expected(megabytes)` rebuilds the exact bytes, for tests that compare them.
"""

import os
import sys

LAST_WORDS = "last words, printed right before exit: é ✓\nand no newline after this"


def blocks(megabytes: int):
    """1 MiB-ish blocks of lines that differ from block to block (ASCII, UTF-8, \\r)."""
    for b in range(megabytes):
        lines = [f"block {b:04d} line {j:05d} {'x' * (j % 97)} ünï ✓\n" for j in range(13000)]
        lines[b % 13000] = f"block {b:04d} progress\r{b}%\r\n"
        yield "".join(lines).encode()


def expected(megabytes: int) -> bytes:
    return b"".join(blocks(megabytes)) + LAST_WORDS.encode()


if __name__ == "__main__":
    megabytes = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    out = sys.stdout.buffer
    for block in blocks(megabytes):
        out.write(block)
    out.write(LAST_WORDS.encode())
    out.flush()
    os._exit(0)
