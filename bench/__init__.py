"""Benchmarks: what torchjobs costs against the floor measured in the same run.

.venv/bin/python -m bench.run            # everything; writes docs/benchmarks.md
.venv/bin/python -m bench.run --smoke    # the short version CI runs (test-artifacts/bench/)
"""
