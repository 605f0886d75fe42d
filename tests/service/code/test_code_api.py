"""Code archives over the API (contract §6): upload, dedup, ownership, and every hostile
archive refused with the member named and nothing kept anywhere: not in the storage, not in the
server's temporary files, and not in a worker's code cache, which checks each archive again
before it unpacks one (workers/code_cache.py) in case one reached the storage another way."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.code.service import storage_key
from service.config import Settings
from service.migrate import upgrade
from service.storage import Storage
from workers.code_cache import CodeUnavailable, unpacked_code

TOKEN = "tj_code_admin_token_0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
BUILTIN = {"kind": "builtin", "model": "mlp", "dataset": "digits"}


def archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return raw.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


GOOD = archive((member("train.py"), b"print('hi')\n"), (member("pkg/__init__.py"), b""))


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    s = Settings(
        home=tmp_path, admin_token=TOKEN, max_code_unpacked_bytes=64 * 1024**2, max_code_members=1000
    )
    upgrade(s)
    return s


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, scheduler=False)) as client:
        yield client


def user(api: TestClient, name: str) -> dict[str, str]:
    created = api.post("/v1/users", json={"name": name}, headers=ADMIN)
    assert created.status_code == 201, created.text
    return {"Authorization": f"Bearer {created.json()['token']}"}


def upload(api: TestClient, data: bytes, headers: dict[str, str], name: str = "proj") -> httpx.Response:
    return api.post(
        "/v1/code",
        params={"name": name},
        content=data,
        headers={**headers, "Content-Type": "application/gzip"},
    )


def nothing_kept(settings: Settings) -> None:
    stored = [p for p in (settings.home / "checkpoints").rglob("*") if p.is_file()]
    assert stored == []
    partials = (
        list((settings.home / "tmp" / "code").glob("*")) if (settings.home / "tmp" / "code").exists() else []
    )
    assert partials == []
    cached = list(settings.cache_dir.rglob("*")) if settings.cache_dir.exists() else []
    assert cached == []  # the API server never writes into a worker's code cache


def _files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not p.is_dir()}


def the_worker_refuses_it_too(settings: Settings, data: bytes, name: str) -> None:
    """A worker handed these bytes anyway (put straight into a storage of its own, as if they
    had got there without the API) refuses them naming `name`, and leaves nothing in its code
    cache (`settings.cache_dir`) or anywhere else under its home: no unpacked folder, no staging
    folder, no partial download, no file a member named. What stays is the 0-byte lock file
    the unpacking takes (one per archive id, reused by the next node that wants it)."""
    sha = hashlib.sha256(data).hexdigest()
    storage = Storage(f"file://{settings.home / 'worker-storage'}")
    local = storage.local_path(storage_key(sha))
    assert local is not None
    Path(local).parent.mkdir(parents=True, exist_ok=True)
    Path(local).write_bytes(data)
    before = _files_under(settings.home)
    with pytest.raises(CodeUnavailable) as refused:
        unpacked_code(settings, storage, sha, storage_key(sha))
    assert "refused" in str(refused.value) and name in str(refused.value)
    lock = settings.cache_dir / "code" / f".{sha}.lock"
    assert sorted(settings.cache_dir.rglob("*")) == [settings.cache_dir / "code", lock]
    assert lock.stat().st_size == 0
    assert _files_under(settings.home) - before == {lock}


def test_upload_is_content_addressed_and_owned(api: TestClient) -> None:
    ann, bob = user(api, "ann"), user(api, "bob")
    first = upload(api, GOOD, ann)
    assert first.status_code == 201, first.text
    code = first.json()
    assert code["id"] == hashlib.sha256(GOOD).hexdigest()
    assert (code["name"], code["owner"], code["files"]) == ("proj", "ann", 2)
    assert code["size_bytes"] == len(GOOD) and code["unpacked_bytes"] == len(b"print('hi')\n")
    again = upload(api, GOOD, ann, name="other")
    assert again.status_code == 200 and again.json() == code
    assert api.get(f"/v1/code/{code['id']}", headers=ann).json() == code
    assert api.get(f"/v1/code/{code['id']}", headers=bob).status_code == 404
    assert api.get(f"/v1/code/{code['id']}", headers=ADMIN).json()["owner"] == "ann"
    assert api.get("/v1/code/not-a-sha", headers=ann).status_code == 404
    assert api.get("/v1/code", headers=bob).json() == {"items": []}
    theirs = upload(api, GOOD, bob)
    assert theirs.status_code == 201 and theirs.json()["owner"] == "bob"
    newer = upload(api, archive((member("b.py"), b"2")), ann)
    assert [c["id"] for c in api.get("/v1/code", headers=ann).json()["items"]] == [
        newer.json()["id"],
        code["id"],
    ]
    assert api.post("/v1/code", content=GOOD).status_code == 401


def _fifo() -> tarfile.TarInfo:
    return member("pipe", tarfile.FIFOTYPE)


def _huge_header(kind: bytes) -> bytes:
    """A pax or long-name header that claims 8 GiB: tarfile would allocate it whole."""
    info = member("././@PaxHeader" if kind == tarfile.XHDTYPE else "././@LongLink", kind)
    info.size = 2**33 - 1
    return gzip.compress(info.tobuf(format=tarfile.USTAR_FORMAT) + bytes(1024))


def _pax_chain(n: int) -> bytes:
    """n pax headers back to back: tarfile recurses once per header."""
    info = member("x", tarfile.XHDTYPE)
    record = b"20 comment=aaaaaaaa\n"
    info.size = len(record)
    block = info.tobuf(format=tarfile.USTAR_FORMAT) + record + bytes(512 - len(record))
    return gzip.compress(block * n + bytes(1024))


def _not_utf8() -> bytes:
    raw = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT, errors="surrogateescape") as tar,
    ):
        info = tarfile.TarInfo(b"\xff/../x".decode("utf-8", "surrogateescape"))
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    return raw.getvalue()


HOSTILE = {
    "dotdot": (archive((member("../../x"), b"x")), "../../x"),
    "absolute": (archive((member("/etc/x"), b"x")), "/etc/x"),
    "symlink-out": (archive((member("link", tarfile.SYMTYPE, "/etc/passwd"), None)), "link"),
    "symlink-up": (archive((member("a/link", tarfile.SYMTYPE, "../../etc/passwd"), None)), "a/link"),
    "hardlink": (archive((member("f"), b"x"), (member("h", tarfile.LNKTYPE, "f"), None)), "h"),
    "fifo": (archive((_fifo(), None)), "pipe"),
    "device": (archive((member("dev", tarfile.CHRTYPE), None)), "dev"),
    "through-a-link": (
        archive((member("a", tarfile.SYMTYPE, "."), None), (member("a/b", tarfile.SYMTYPE, ".."), None)),
        "a/b",
    ),
    "link-via-link": (
        archive((member("a", tarfile.SYMTYPE, "."), None), (member("c", tarfile.SYMTYPE, "a/.."), None)),
        "c",
    ),
    "huge-pax-header": (_huge_header(tarfile.XHDTYPE), "header"),
    "huge-long-name": (_huge_header(tarfile.GNUTYPE_LONGNAME), "header"),
    "pax-recursion": (_pax_chain(3000), "not a gzip-compressed tar"),
    "not-utf8": (_not_utf8(), "/../x"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_archive_is_refused_naming_the_member(
    api: TestClient, settings: Settings, case: str
) -> None:
    data, name = HOSTILE[case]
    answer = upload(api, data, ADMIN)
    assert answer.status_code == 422, answer.text
    assert name in answer.json()["detail"][0]["msg"]
    assert api.get("/v1/code", headers=ADMIN).json() == {"items": []}
    nothing_kept(settings)
    the_worker_refuses_it_too(settings, data, name)


def test_a_gzip_bomb_stops_at_the_limit(api: TestClient, settings: Settings) -> None:
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        info = member("zeros.bin")
        info.size = 200 * 1024**2  # past the 64 MiB limit of this server
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    bomb = raw.getvalue()
    assert len(bomb) < 1024**2  # under 1 MB on the wire
    answer = upload(api, bomb, ADMIN)
    assert answer.status_code == 422 and "zeros.bin" in answer.json()["detail"][0]["msg"]
    nothing_kept(settings)
    the_worker_refuses_it_too(settings, bomb, "zeros.bin")


def test_too_many_members_and_bodies_that_are_not_archives(api: TestClient, settings: Settings) -> None:
    many = archive(*((member(f"f{i}"), b"") for i in range(1001)))
    answer = upload(api, many, ADMIN)
    assert answer.status_code == 422 and "more than 1000 members" in answer.json()["detail"][0]["msg"]
    for body in (b"not a tar at all", gzip.compress(b"not a tar either" * 100), b""):
        answer = upload(api, body, ADMIN)
        assert answer.status_code == 422, (body[:10], answer.text)
    nothing_kept(settings)
    the_worker_refuses_it_too(settings, many, "more than 1000 members")


def empty_files(count: int) -> bytes:
    """A .tar.gz of `count` empty files f/000000, f/000001, ..., streamed through zlib.

    tarfile makes the one header; each member is that header with its name and checksum
    rewritten (what `tarfile.addfile` would write for it), about 40 times faster than calling
    `addfile` 200,000 times."""
    template = bytearray(tarfile.TarInfo("f/000000").tobuf(format=tarfile.USTAR_FORMAT))
    assert len(template) == tarfile.BLOCKSIZE and template[0:9] == b"f/000000\0"
    rest = sum(template) - sum(template[148:156]) + 8 * ord(" ") - sum(b"f/000000")
    gz = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # a gzip stream
    out = io.BytesIO()
    for i in range(count):
        name = b"f/%06d" % i
        template[0:8] = name
        template[148:156] = b"%06o\0 " % (rest + sum(name))
        out.write(gz.compress(template))
    out.write(gz.compress(bytes(2 * tarfile.BLOCKSIZE)))  # the end-of-archive marker
    out.write(gz.flush())
    return out.getvalue()


def test_two_hundred_thousand_empty_files_at_the_default_member_limit(tmp_path: Path) -> None:
    defaults = Settings(home=tmp_path, admin_token=TOKEN)  # every TORCHJOBS_MAX_CODE_* at its default
    limit = defaults.max_code_members
    assert limit == Settings.model_fields["max_code_members"].default  # not one set in the environment
    data = empty_files(200_000)
    raw = gzip.decompress(data)  # what was built is what was meant: 200,000 valid headers
    assert len(raw) == 200_000 * tarfile.BLOCKSIZE + 2 * tarfile.BLOCKSIZE
    for i in (0, 1, 99_999, 100_000, 199_999):
        header = tarfile.TarInfo.frombuf(raw[i * 512 : (i + 1) * 512], "utf-8", "surrogateescape")  # checksum
        assert (header.name, header.size, header.type) == (f"f/{i:06d}", 0, tarfile.REGTYPE)
    upgrade(defaults)
    with TestClient(create_app(defaults, scheduler=False)) as api:
        answer = upload(api, data, ADMIN)
        if limit >= 200_000:  # a default that takes them: the archive is stored, all of it counted
            assert answer.status_code == 201, answer.text
            assert answer.json()["files"] == 200_000
            return
        assert answer.status_code == 422, answer.text
        (error,) = answer.json()["detail"]
        assert error["msg"] == f"f/{limit:06d}: the archive has more than {limit} members"
        assert error["loc"] == ["body", "archive", f"f/{limit:06d}"]  # the first member past the limit
        assert api.get("/v1/code", headers=ADMIN).json() == {"items": []}
    nothing_kept(defaults)
    the_worker_refuses_it_too(defaults, data, f"more than {limit} members")


def test_past_the_compressed_limit_is_a_413(tmp_path: Path) -> None:
    small = Settings(home=tmp_path, admin_token=TOKEN, max_code_bytes=1024)
    upgrade(small)
    with TestClient(create_app(small, scheduler=False)) as api:
        answer = upload(api, archive((member("big"), os.urandom(4096))), ADMIN)  # incompressible
        assert answer.status_code == 413
        assert api.get("/v1/code", headers=ADMIN).json() == {"items": []}


def job(**fields: object) -> dict[str, object]:
    return {"mode": "single", "entrypoint": BUILTIN, **fields}


def test_a_job_names_only_its_owners_code(api: TestClient) -> None:
    ann, bob = user(api, "ann"), user(api, "bob")
    code = upload(api, GOOD, ann).json()["id"]
    accepted = api.post("/v1/jobs", json=job(code=code), headers=ann)
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["code"] == code
    refused = api.post("/v1/jobs", json=job(code=code), headers=bob)
    assert refused.status_code == 422 and refused.json()["detail"][0]["msg"] == "no such code"
    assert refused.json()["detail"][0]["loc"] == ["body", "code"]
    assert api.post("/v1/jobs", json=job(code="xyz"), headers=ann).status_code == 422
    escape = {"kind": "script", "path": "../outside.py", "args": []}
    answer = api.post("/v1/jobs", json=job(code=code, entrypoint=escape), headers=ann)
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "entrypoint", "path"]


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("torch==2.1", "worker's own"),
        ("Torch", "worker's own"),
        ("torchjobs", "worker's own"),
        ("--index-url=https://example.com", "options"),
        ("-e .", "options"),
        ("git+https://example.com/x.git", "PEP 508"),
        ("pkg @ https://example.com/pkg.whl", "URLs"),
        ("./local", "PEP 508"),
    ],
)
def test_pip_holds_requirement_specifiers_only(api: TestClient, item: str, why: str) -> None:
    answer = api.post("/v1/jobs", json=job(environment={"pip": ["einops==0.8.2", item]}), headers=ADMIN)
    assert answer.status_code == 422, answer.text
    error = answer.json()["detail"][0]
    assert error["loc"] == ["body", "environment", "pip", 1] and why in error["msg"]
    assert api.get("/v1/jobs", headers=ADMIN).json()["items"] == []


def test_pip_takes_at_most_a_hundred(api: TestClient) -> None:
    answer = api.post("/v1/jobs", json=job(environment={"pip": [f"p{i}" for i in range(101)]}), headers=ADMIN)
    assert answer.status_code == 422
    ok = api.post("/v1/jobs", json=job(environment={"pip": ["einops==0.8.2"]}), headers=ADMIN)
    assert ok.status_code == 201 and ok.json()["environment"] == {"pip": ["einops==0.8.2"]}


def test_links_inside_and_odd_names_are_accepted(api: TestClient) -> None:
    chain = archive(
        (member("lib.so.1.2"), b"elf"),
        (member("lib.so.1", tarfile.SYMTYPE, "lib.so.1.2"), None),
        (member("lib.so", tarfile.SYMTYPE, "lib.so.1"), None),
        (member("data:v1/x.csv"), b"1,2\n"),
    )
    answer = upload(api, chain, ADMIN)
    assert answer.status_code == 201, answer.text
    assert answer.json()["files"] == 2
