"""The client's TLS context: httpx's verifying one for an https API, and for plain http one
that trusts nothing, so a CLI command does not parse certifi's bundle for a connection that
has no TLS (and a TLS connection it never makes would fail closed)."""

from __future__ import annotations

import ssl

import httpx
import pytest

from service.client.api import Client, tls_for


def test_an_https_api_gets_httpx_s_verifying_context() -> None:
    assert tls_for("https://jobs.example.com") is True
    assert tls_for(" HTTPS://jobs.example.com/") is True


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "HTTP://jobs.example.com/", "jobs.example.com"])
def test_a_plain_http_api_gets_a_context_that_trusts_nothing(url: str) -> None:
    context = tls_for(url)
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] == 0  # no trust anchor: any certificate fails


def test_the_client_still_talks_plain_http() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, json={"name": "admin"})

    with Client("http://127.0.0.1:9", "t", transport=httpx.MockTransport(answer)) as client:
        assert client.http.get("/v1/me").json() == {"name": "admin"}
    assert seen == ["http://127.0.0.1:9/v1/me"]
