"""Errors the runtime raises, each with a message meant for the job's owner.

    TorchJobsRuntimeError            anything that stops a rank before or during training
    ├── ConfigError                  config.json or the rank's environment is wrong
    ├── FactoryError                 a factory "module:callable" cannot be imported or called
    └── CheckpointError              a resume checkpoint is unreadable, refused or does not fit

`Preempted` is not an error: it unwinds the training loop after SIGTERM once the checkpoint is
written, and `train.main` turns it into exit code 75.
"""

from __future__ import annotations

PREEMPTED_EXIT_CODE = 75


class TorchJobsRuntimeError(Exception):
    """Base of the runtime's errors; its message is what the platform shows as the job's error."""


class ConfigError(TorchJobsRuntimeError):
    """config.json or the environment contradicts itself or this machine."""


class FactoryError(TorchJobsRuntimeError):
    """A factory entrypoint failed to import, resolve or build."""


class CheckpointError(TorchJobsRuntimeError):
    """A checkpoint could not be read safely, or its contents do not fit the model."""


class Preempted(Exception):  # a control-flow signal, not an error
    """Raised after a SIGTERM once every rank has stopped and rank 0 has saved a checkpoint."""
