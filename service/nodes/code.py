"""What a worker needs to run a job's code: where an uploaded archive is stored, the limits and
the safe unpacking it was checked with at upload, and the real file a script entrypoint names."""

from __future__ import annotations

from service.code.archive import UnsafeArchive, unpack_archive
from service.code.service import limits_of, storage_key
from service.jobs.validation import resolve_script

__all__ = ["UnsafeArchive", "limits_of", "resolve_script", "storage_key", "unpack_archive"]
