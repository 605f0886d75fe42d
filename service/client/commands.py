"""Client commands over the REST API, each subject in its module: the jobs (`job_commands`:
submit, ls, show, watch, logs, cancel), your code (`code_commands`: code push|ls) and the
checkpoints (`checkpoint_commands`: checkpoints, download, upload) and the metrics
(`metric_commands`: metrics, tensorboard); into a running job (`exec_commands`: exec, shell,
forward, contract §14).

Every command takes `--output json` for scripts. `watch` exits 0 when the job succeeded,
1 when it failed and 3 when it was cancelled; API errors exit 2 with the server's reason.
"""

from __future__ import annotations

import typer

from service.client import checkpoint_commands, code_commands, exec_commands, job_commands, metric_commands
from service.client.common import CLIENT_DEFAULTS, ClientDefaults, TokenOpt, UrlOpt

# the app's callback (service/cli/main.py) takes these for `torchjobs --url U --token T COMMAND`
__all__ = ["CLIENT_DEFAULTS", "ClientDefaults", "TokenOpt", "UrlOpt", "register"]


def register(app: typer.Typer) -> None:
    """The commands in the order `torchjobs --help` lists them."""
    job_commands.register(app)
    code_commands.register(app)
    checkpoint_commands.register(app)
    exec_commands.register(app)
    metric_commands.register(app)
