"""The client: the REST API over httpx (`api`), resumable checked downloads (`download`) and
the `torchjobs` client commands (`commands`). It imports nothing of the server's models or
database (tests/test_boundaries.py checks it), so it can ship and run on a laptop alone."""

from service.client.api import TERMINAL, ApiError, Client

__all__ = ["TERMINAL", "ApiError", "Client"]
