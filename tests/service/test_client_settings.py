"""The client's own settings (service/client/settings.py) read what the server's `Settings`
reads: the same variables, `.env`, defaults and precedence, so the CLI finds the same server
and token as it did when it built the server's configuration."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from service.client import common
from service.client.api import Client
from service.client.settings import ClientSettings
from service.config import Settings


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.upper().startswith("TORCHJOBS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def same(client: ClientSettings, server: Settings) -> None:
    assert client.home == server.home
    assert client.url == server.url
    assert client.token == server.token
    assert client.admin_token == server.admin_token
    assert client.admin_token_file == server.admin_token_file


@pytest.mark.parametrize(
    ("env", "dotenv"),
    [
        pytest.param({}, "", id="defaults"),
        pytest.param(
            {"TORCHJOBS_URL": "http://api:9000", "TORCHJOBS_TOKEN": "t1", "TORCHJOBS_HOME": "/srv/tj"},
            "",
            id="environment",
        ),
        pytest.param({}, "TORCHJOBS_URL=http://dotenv:1\nTORCHJOBS_ADMIN_TOKEN=a1\n", id="dotenv"),
        pytest.param(
            {"TORCHJOBS_URL": "http://env:2", "torchjobs_token": "lower"},
            "TORCHJOBS_URL=http://dotenv:1\nTORCHJOBS_TOKEN=d\nTORCHJOBS_HOME=/from/dotenv\n",
            id="environment-over-dotenv",
        ),
    ],
)
def test_the_client_reads_its_settings_as_the_server_does(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], dotenv: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if dotenv:
        (clean_env / ".env").write_text(dotenv)
    same(ClientSettings(), Settings())


def test_a_command_finds_the_admin_token_file_under_home(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = clean_env / "home"
    home.mkdir()
    (home / "admin.token").write_text("from-file\n")
    monkeypatch.setenv("TORCHJOBS_HOME", str(home))
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"items": []})

    def client(url: str, token: str | None) -> Client:
        return Client(url, token, transport=httpx.MockTransport(answer))

    monkeypatch.setattr(common, "Client", client)
    with common.make_client(None, None) as made:
        made.list_code()
    assert seen[0].headers["Authorization"] == "Bearer from-file"
    assert str(seen[0].url).startswith("http://127.0.0.1:8000/v1/code")
