"""The webhook routes (contract §10): registration and its refusals, ownership, the per-user
limit, and the delivery history; every bad input a clear 4xx."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from tests.factories import make_job, move_job

TOKEN = "tj_hooks_admin_token_0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PUBLIC = "http://1.1.1.1/hook"  # a global address, as a literal: no DNS needed


def settings_for(tmp_path: Path, **extra: object) -> Settings:
    s = Settings(home=tmp_path, admin_token=TOKEN, **extra)  # type: ignore[arg-type]
    upgrade(s)
    return s


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return settings_for(tmp_path)


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, scheduler=False)) as client:
        yield client


def user(api: TestClient, name: str) -> dict[str, str]:
    created = api.post("/v1/users", json={"name": name}, headers=ADMIN)
    assert created.status_code == 201, created.text
    return {"Authorization": f"Bearer {created.json()['token']}"}


def loc_of(resp: object) -> list[object]:
    return resp.json()["detail"][0]["loc"]  # type: ignore[attr-defined]


def test_register_list_and_delete_own_webhooks_only(api: TestClient) -> None:
    alice, bob = user(api, "alice"), user(api, "bob")
    made = api.post("/v1/webhooks", json={"url": PUBLIC}, headers=alice)
    assert made.status_code == 201, made.text
    body = made.json()
    assert re.fullmatch(r"[0-9a-f]{64}", body["secret"])  # generated, shown this once
    assert (body["url"], body["events"], body["all"], body["owner"]) == (PUBLIC, ["state"], False, "alice")
    given = api.post(
        "/v1/webhooks",
        json={"url": PUBLIC, "events": ["checkpoint", "state", "checkpoint"], "secret": "s" * 16},
        headers=alice,
    )
    assert given.status_code == 201 and given.json()["secret"] == "s" * 16
    assert given.json()["events"] == ["checkpoint", "state"]

    listed = api.get("/v1/webhooks", headers=alice).json()["items"]
    assert [w["id"] for w in listed] == [body["id"], given.json()["id"]]
    assert all("secret" not in w for w in listed)
    assert api.get("/v1/webhooks", headers=bob).json()["items"] == []
    assert len(api.get("/v1/webhooks", headers=ADMIN).json()["items"]) == 2  # the admin sees all

    assert api.delete(f"/v1/webhooks/{body['id']}", headers=bob).status_code == 404  # not bob's
    assert api.get(f"/v1/webhooks/{body['id']}/deliveries", headers=bob).status_code == 404
    assert api.delete(f"/v1/webhooks/{body['id']}", headers=alice).status_code == 204
    assert api.delete(f"/v1/webhooks/{body['id']}", headers=alice).status_code == 404
    assert api.delete(f"/v1/webhooks/{given.json()['id']}", headers=ADMIN).status_code == 204
    assert api.get("/v1/webhooks", headers=alice).json()["items"] == []


@pytest.mark.parametrize("secret", ["s3cret", "my shared secret", "ключ-🔑"])
def test_any_secret_without_control_characters_is_taken(api: TestClient, secret: str) -> None:
    made = api.post("/v1/webhooks", json={"url": PUBLIC, "secret": secret}, headers=ADMIN)
    assert made.status_code == 201, made.text
    assert made.json()["secret"] == secret


def test_a_host_that_does_not_resolve_yet_is_taken_and_checked_at_each_delivery(api: TestClient) -> None:
    """Contract §10 refuses a host that resolves to a private address; one that resolves to
    nothing yet is no such host. Its sends are failed attempts (delivery's own tests)."""
    made = api.post("/v1/webhooks", json={"url": "http://no-such-host.invalid/hook"}, headers=ADMIN)
    assert made.status_code == 201, made.text


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://localhost/hook", "loopback"),
        ("http://127.0.0.1:8000/hook", "loopback"),
        ("http://[::1]/hook", "loopback"),
        ("http://10.0.0.1/hook", "private"),
        ("https://192.168.1.10/hook", "private"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://0.0.0.0/", "private"),
        ("http://[::ffff:127.0.0.1]/", "loopback"),
        ("ftp://1.1.1.1/hook", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("1.1.1.1/hook", "only http and https"),
        ("http:///hook", "no host"),
        ("http://[::1/hook", "not a valid URL"),
        ("http://1.1.1.1:70000/", "not a valid URL"),
        ("http://user:pw@1.1.1.1/", "credentials"),
        ("http://1.1.1.1/a b", "spaces"),
    ],
)
def test_a_url_that_is_no_target_is_a_422_naming_url(api: TestClient, url: str, why: str) -> None:
    resp = api.post("/v1/webhooks", json={"url": url}, headers=ADMIN)
    assert resp.status_code == 422, resp.text
    assert loc_of(resp) == ["body", "url"]
    assert why in resp.json()["detail"][0]["msg"]


@pytest.mark.parametrize("ipv4", ["169.254.169.254", "127.0.0.1", "10.0.0.1"])
@pytest.mark.parametrize(
    "embedding",
    [
        "::ffff:{}",  # IPv4-mapped
        "::{}",  # IPv4-compatible
        "64:ff9b::{}",  # NAT64
        "64:ff9b:1::{}",  # NAT64 for local use
        "2002:{:04x}:{:04x}::1",  # 6to4
        "2001:0:4136:e378:8000:63bf:{:04x}:{:04x}",  # Teredo: the client's address, bits inverted
    ],
)
def test_an_internal_ipv4_address_inside_an_ipv6_one_is_a_422(
    api: TestClient, embedding: str, ipv4: str
) -> None:
    """Contract §7: refused as the IPv4 address it embeds would be."""
    n = int(ipaddress.IPv4Address(ipv4))
    if embedding.startswith("2002:"):
        address = embedding.format(n >> 16, n & 0xFFFF)
    elif embedding.startswith("2001:"):
        address = embedding.format((n ^ 0xFFFFFFFF) >> 16, (n ^ 0xFFFFFFFF) & 0xFFFF)
    else:
        address = embedding.format(ipv4)
    resp = api.post("/v1/webhooks", json={"url": f"http://[{address}]/hook"}, headers=ADMIN)
    assert resp.status_code == 422, resp.text
    assert loc_of(resp) == ["body", "url"]
    assert "loopback, link-local or private" in resp.json()["detail"][0]["msg"]


@pytest.mark.parametrize("url", ["http://[64:ff9b::8.8.8.8]/hook", "http://[2002:808:808::1]/hook"])
def test_a_public_ipv4_address_inside_an_ipv6_one_is_taken(api: TestClient, url: str) -> None:
    made = api.post("/v1/webhooks", json={"url": url}, headers=ADMIN)
    assert made.status_code == 201, made.text


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"url": PUBLIC, "events": ["state", "log"]}, ["body", "events", 1]),
        ({"url": PUBLIC, "events": []}, ["body", "events"]),
        ({"url": PUBLIC, "events": "state"}, ["body", "events"]),
        ({"url": PUBLIC, "all": "true"}, ["body", "all"]),
        ({"url": PUBLIC, "secret": ""}, ["body", "secret"]),
        ({"url": PUBLIC, "secret": "tab\there"}, ["body", "secret"]),  # a control character
        ({"url": PUBLIC, "secret": "a" * 257}, ["body", "secret"]),
        ({"url": PUBLIC, "colour": "red"}, ["body", "colour"]),
        ({"url": "http://1.1.1.1/\x00"}, ["body", "url"]),
        ({"url": "http://1.1.1.1/" + "a" * 2048}, ["body", "url"]),
        ({"url": 5}, ["body", "url"]),
        ({}, ["body", "url"]),
    ],
)
def test_a_bad_body_is_a_422_naming_its_field(api: TestClient, body: dict, loc: list) -> None:
    resp = api.post("/v1/webhooks", json=body, headers=ADMIN)
    assert resp.status_code == 422, resp.text
    assert loc_of(resp) == loc


def test_strings_the_database_cannot_store_and_non_json_are_4xx(api: TestClient) -> None:
    headers = {**ADMIN, "Content-Type": "application/json"}
    surrogate = b'{"url": "http://1.1.1.1/\\ud800"}'
    resp = api.post("/v1/webhooks", content=surrogate, headers=headers)
    assert resp.status_code == 422 and loc_of(resp) == ["body", "url"], resp.text
    resp = api.post(
        "/v1/webhooks",
        content=b'{"url": "http://1.1.1.1/", "secret": "\\ud800' + b"a" * 20 + b'"}',
        headers=headers,
    )
    assert resp.status_code == 422, resp.text
    assert api.post("/v1/webhooks", content=b"{not json", headers=headers).status_code == 422
    assert api.post("/v1/webhooks", content=b"[]", headers=headers).status_code == 422


def test_all_jobs_is_the_admins_only(api: TestClient) -> None:
    alice = user(api, "alice")
    refused = api.post("/v1/webhooks", json={"url": PUBLIC, "all": True}, headers=alice)
    assert refused.status_code == 422 and loc_of(refused) == ["body", "all"]
    made = api.post("/v1/webhooks", json={"url": PUBLIC, "all": True}, headers=ADMIN)
    assert made.status_code == 201 and made.json()["all"] is True


def test_at_most_twenty_webhooks_per_user(api: TestClient) -> None:
    alice, bob = user(api, "alice"), user(api, "bob")
    for _ in range(20):
        assert api.post("/v1/webhooks", json={"url": PUBLIC}, headers=alice).status_code == 201
    over = api.post("/v1/webhooks", json={"url": PUBLIC}, headers=alice)
    assert over.status_code == 409 and "at most 20" in over.json()["detail"]
    assert api.post("/v1/webhooks", json={"url": PUBLIC}, headers=bob).status_code == 201  # per user
    first = api.get("/v1/webhooks", headers=alice).json()["items"][0]["id"]
    assert api.delete(f"/v1/webhooks/{first}", headers=alice).status_code == 204
    assert api.post("/v1/webhooks", json={"url": PUBLIC}, headers=alice).status_code == 201


def test_no_token_is_a_401_an_unknown_id_a_404_and_a_malformed_one_a_422(api: TestClient) -> None:
    assert api.post("/v1/webhooks", json={"url": "http://localhost/"}).status_code == 401
    assert api.get("/v1/webhooks").status_code == 401
    assert api.delete("/v1/webhooks/1").status_code == 401
    assert api.get("/v1/webhooks/1/deliveries").status_code == 401
    for unknown in ("0", "-1", str(2**31)):  # integers no webhook can have: unknown, not invalid
        assert api.delete(f"/v1/webhooks/{unknown}", headers=ADMIN).status_code == 404
        assert api.get(f"/v1/webhooks/{unknown}/deliveries", headers=ADMIN).status_code == 404
    assert api.delete("/v1/webhooks/abc", headers=ADMIN).status_code == 422
    assert api.get("/v1/webhooks/abc/deliveries", headers=ADMIN).status_code == 422
    assert api.delete("/v1/webhooks/12345", headers=ADMIN).status_code == 404
    assert api.put("/v1/webhooks/1", headers=ADMIN).status_code == 405


def test_with_the_setting_a_private_target_is_allowed(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, webhook_allow_private=True)
    with TestClient(create_app(settings, scheduler=False)) as api:
        for url in ("http://localhost:9/hook", "http://127.0.0.1:9/", "http://10.0.0.1/"):
            assert api.post("/v1/webhooks", json={"url": url}, headers=ADMIN).status_code == 201
        # what is no URL stays refused
        assert api.post("/v1/webhooks", json={"url": "ftp://127.0.0.1/"}, headers=ADMIN).status_code == 422


def test_deliveries_newest_first_paged_with_the_event_id(api: TestClient, settings: Settings) -> None:
    alice = user(api, "alice")
    me = api.get("/v1/me", headers=alice).json()
    hook = api.post("/v1/webhooks", json={"url": PUBLIC, "events": ["state"]}, headers=alice).json()
    db = Database(settings)
    try:
        with db.transaction() as s:
            job = make_job(s, me["id"])  # queued: event 1
            move_job(s, job, "running")  # scheduled, running: events 2, 3
            job_id = job.id
    finally:
        db.dispose()
    first = api.get(f"/v1/webhooks/{hook['id']}/deliveries", params={"limit": 2}, headers=alice).json()
    assert [d["event_id"] for d in first["items"]] == [f"{job_id}:3", f"{job_id}:2"]
    assert all(d["status"] == "pending" and d["attempts"] == [] for d in first["items"])
    assert first["items"][0]["attempt_count"] == 0 and first["items"][0]["next_attempt_at"]
    rest = api.get(
        f"/v1/webhooks/{hook['id']}/deliveries", params={"cursor": first["next_cursor"]}, headers=alice
    ).json()
    assert [d["seq"] for d in rest["items"]] == [1] and rest["next_cursor"] is None
    for params in ({"cursor": "x"}, {"cursor": "-1"}, {"limit": 0}, {"limit": 101}):
        bad = api.get(f"/v1/webhooks/{hook['id']}/deliveries", params=params, headers=alice)
        assert bad.status_code == 422, (params, bad.text)
    admin_view = api.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=ADMIN)
    assert admin_view.status_code == 200 and len(admin_view.json()["items"]) == 3
