"""torchjobs control plane: API, database, scheduler, storage and auth."""

__version__ = "0.1.0"
