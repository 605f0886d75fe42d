"""The client: the REST API over httpx (`api`, its errors in `errors`), resumable checked
downloads (`download`), its own settings (`settings`: the server's URL and a token, read as
the server reads them) and the `torchjobs` client commands (`commands` registers them: jobs,
code, checkpoints; `admin_commands`, `webhook_commands`). It imports nothing of the server,
its configuration included, only `service.states` (tests/test_boundaries.py checks it), so it
can ship and run on a laptop alone."""

from service.client.api import TERMINAL, ApiError, Client

__all__ = ["TERMINAL", "ApiError", "Client"]
