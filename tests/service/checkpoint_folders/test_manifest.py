"""The manifest (contract §11) and the path rule, on their own."""

from __future__ import annotations

import hashlib

import pytest

from service.checkpoints.manifest import folder_name, manifest_of, unsafe_path_reason


def test_the_manifest_is_sorted_by_utf8_bytes() -> None:
    # U+FF5E sorts after U+1F600 as a Python string (UTF-16 surrogates aside) but before it as
    # UTF-8 bytes (EF BD 9E < F0 9F 98 80); "B" (42) before "a" (61).
    rows = [("😀.bin", 1, "c" * 64), ("～.bin", 2, "b" * 64), ("a", 0, "e3" * 32), ("B/x", 10, "d" * 64)]
    data, digest = manifest_of(rows)
    lines = data.decode().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == ["B/x", "a", "～.bin", "😀.bin"]
    assert lines[1] == f"{'e3' * 32} 0 a" and data.endswith(b"\n")
    assert digest == hashlib.sha256(data).hexdigest()
    assert manifest_of(list(reversed(rows))) == (data, digest)
    assert manifest_of([]) == (b"", hashlib.sha256(b"").hexdigest())


@pytest.mark.parametrize(
    "path",
    ["", "/abs", "\\abs", "../x", "a/../../x", "a\\..\\..\\x", "a//b", "./a", "a/.", "a/", "nul\0", "tab\tx"],
)
def test_paths_that_may_not_name_a_file(path: str) -> None:
    assert unsafe_path_reason(path) is not None


@pytest.mark.parametrize("path", ["a", "a/b/c.pt", "rng_state_0.pth", "..hid", "a..b", "back\\slash", "ü/é"])
def test_paths_that_may(path: str) -> None:
    assert unsafe_path_reason(path) is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [("checkpoint-5", "checkpoint-5"), ("a/b", "a_b"), ("..", "checkpoint-7"), ("", "checkpoint-7")],
)
def test_the_folder_a_checkpoint_unpacks_into(name: str, expected: str) -> None:
    assert folder_name(name, 7) == expected
