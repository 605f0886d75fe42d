"""The client's own settings: the four of `service.config.Settings` that a laptop needs.

They are read exactly as the server's `Settings` reads them (prefix ``TORCHJOBS_``, an
optional ``.env``, the same defaults), so the CLI finds the same server and token; only the
client does not build, or need, the server's configuration.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TORCHJOBS_", env_file=".env", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".torchjobs")
    url: str = "http://127.0.0.1:8000"
    token: str | None = None
    admin_token: str | None = None

    @property
    def admin_token_file(self) -> Path:
        """Where `torchjobs up` writes the admin's token (Settings.admin_token_file)."""
        return self.home / "admin.token"
