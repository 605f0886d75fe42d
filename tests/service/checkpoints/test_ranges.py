"""`Range` parsing (RFC 9110, single ranges): what is served, what is ignored, what is a 416."""

from __future__ import annotations

import pytest

from service.checkpoints.service import UnsatisfiableRange, parse_range

SIZE = 1000


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("bytes=0-0", (0, 1)),
        ("bytes=0-999", (0, 1000)),
        ("bytes=10-", (10, 1000)),
        ("bytes=990-5000", (990, 1000)),
        ("bytes=-1", (999, 1000)),
        ("bytes=-5000", (0, 1000)),
        (" Bytes = 5 - 9 ", (5, 10)),
        # ignored: the whole file is sent
        ("bytes=0-1,4-5", None),
        ("items=0-5", None),
        ("bytes=5-4", None),
        ("bytes=a-b", None),
        ("bytes=-", None),
        ("bytes 0-5", None),
        ("bytes=+1-2", None),
    ],
)
def test_parse_range(header: str | None, expected: tuple[int, int] | None) -> None:
    assert parse_range(header, SIZE) == expected


@pytest.mark.parametrize(("header", "size"), [("bytes=1000-", SIZE), ("bytes=-0", SIZE), ("bytes=0-", 0)])
def test_unsatisfiable(header: str, size: int) -> None:
    with pytest.raises(UnsatisfiableRange) as info:
        parse_range(header, size)
    assert info.value.status_code == 416 and info.value.size == size
