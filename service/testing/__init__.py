"""Helpers that drive a real torchjobs stack from outside, shared by tests/ and bench/ (as
Prefect keeps `prefect.testing`): the installed `torchjobs` command run as subprocesses against
real SQLite, PostgreSQL and Redis, and the product's own process discovery. Nothing here is
imported by the server or the workers (tests/test_boundaries.py checks it), and it needs a
source checkout: its jobs run the scripts under tests/scripts."""
