"""The installed torchjobs version, recorded in every checkpoint's meta."""

from __future__ import annotations

from importlib import metadata


def torchjobs_version() -> str:
    try:
        return metadata.version("torchjobs")
    except metadata.PackageNotFoundError:
        return "0+unknown"
