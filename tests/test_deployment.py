"""The production deployment, checked without Docker (this environment has none).

`docker-compose.yml` is validated against the Compose Specification's JSON schema (vendored in
tests/data/, see compose-spec.md there), then read for what torchjobs needs: the five services,
the GPU reservation, the shared checkpoint volume, healthchecks and start-up ordering, and
commands that the real `torchjobs` CLI accepts. The Dockerfile is read for its base image, its
torch pin and its `torchjobs` entrypoint.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer
import yaml
from packaging.requirements import Requirement

from service.cli.main import app as cli_app

REPO = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((REPO / "tests" / "data" / "compose-spec.json").read_text())
COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_TEXT)
SERVICES: dict[str, Any] = COMPOSE["services"]
TORCHJOBS_SERVICES = ("migrate", "api", "worker")
DOCKERFILE = (REPO / "Dockerfile").read_text()
# The schema says draft-07 (as "https://json-schema.org/draft-07/schema", a spelling jsonschema's
# lookup does not know), so the validator class is named rather than looked up.
assert "draft-07" in SCHEMA["$schema"]
VALIDATOR = jsonschema.Draft7Validator


def test_compose_file_matches_the_compose_specification() -> None:
    VALIDATOR.check_schema(SCHEMA)
    errors = sorted(VALIDATOR(SCHEMA).iter_errors(COMPOSE), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_the_schema_rejects_what_compose_would_reject() -> None:
    """The validation has teeth: a misspelt key and a wrong type are both caught."""
    validator = VALIDATOR(SCHEMA)
    bad_key = {"services": {"api": {"image": "x", "helthcheck": {}}}}
    bad_type = {
        "services": {"api": {"image": "x", "deploy": {"resources": {"reservations": {"devices": "gpu"}}}}}
    }
    assert not validator.is_valid(bad_key)
    assert not validator.is_valid(bad_type)


def test_services_and_their_commands() -> None:
    assert set(SERVICES) == {"postgres", "redis", "migrate", "api", "worker"}
    assert SERVICES["postgres"]["image"].startswith("postgres:")
    assert SERVICES["redis"]["image"].startswith("redis:")
    assert SERVICES["migrate"]["command"] == ["db", "upgrade"]
    assert SERVICES["migrate"]["restart"] == "no"
    assert SERVICES["api"]["command"][:3] == ["server", "--host", "0.0.0.0"]
    assert SERVICES["worker"]["command"][0] == "worker"
    worker_args = SERVICES["worker"]["command"]
    assert worker_args[worker_args.index("--accelerator") + 1] == "cuda"
    for name in TORCHJOBS_SERVICES:
        service = SERVICES[name]
        assert service["build"]["context"] == "." and service["build"]["dockerfile"] == "Dockerfile"
        env = service["environment"]
        assert (
            env["TORCHJOBS_DATABASE_URL"].startswith("postgresql://")
            and "@postgres:5432/" in env["TORCHJOBS_DATABASE_URL"]
        )
        assert env["TORCHJOBS_BROKER_URL"].startswith("redis://redis:6379")
        assert "${TORCHJOBS_ADMIN_TOKEN:?" in env["TORCHJOBS_ADMIN_TOKEN"], "no default admin token"


def cli_parse(args: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse a `torchjobs` command line with the real CLI, running nothing: (command, options)."""
    command = typer.main.get_command(cli_app)
    while hasattr(command, "commands"):  # a group (`torchjobs`, `torchjobs db`): its subcommand
        command, args = command.commands[args[0]], args[1:]
    ctx = command.make_context(command.name, list(args))  # raises on an unknown option or a bad value
    return command.name, ctx.params


def test_commands_are_accepted_by_the_real_cli() -> None:
    def parse(name: str) -> tuple[str, dict[str, Any]]:
        return cli_parse([_interpolated(a) for a in SERVICES[name]["command"]])

    assert parse("migrate") == ("upgrade", {})
    assert parse("api") == ("server", {"host": "0.0.0.0", "port": 8000, "no_scheduler": False, "workers": 1})
    name, params = parse("worker")
    assert name == "worker"
    assert params == {"name": "gpu-1", "gpus": None, "accelerator": "cuda", "address": "worker"}
    with pytest.raises(Exception, match="(?i)no such option"):
        cli_parse(["worker", "--name", "w", "--gpu-count", "2"])


def test_gpu_worker_reserves_nvidia_gpus() -> None:
    devices = SERVICES["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), devices
    assert "deploy" not in SERVICES["api"], "the API needs no GPU"


def test_checkpoints_are_one_volume_shared_by_the_api_and_the_workers() -> None:
    assert "checkpoints" in COMPOSE["volumes"]
    for name in ("api", "worker"):
        service = SERVICES[name]
        storage = service["environment"]["TORCHJOBS_STORAGE_URL"]
        assert storage.startswith("file://")
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        assert mounts.get(storage.removeprefix("file://")) == "checkpoints", (name, mounts)


def test_start_up_order_and_healthchecks() -> None:
    for name in ("postgres", "redis", "api", "worker"):
        assert SERVICES[name]["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    for name in ("api", "worker"):
        deps = SERVICES[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully"
        assert deps["postgres"]["condition"] == "service_healthy"
        assert deps["redis"]["condition"] == "service_healthy"
    assert SERVICES["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    # Whatever is waited on as healthy has a healthcheck.
    for name, service in SERVICES.items():
        for dep, cond in service.get("depends_on", {}).items():
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep} to be healthy"


def test_python_healthchecks_compile() -> None:
    for name in ("api", "worker"):
        test = SERVICES[name]["healthcheck"]["test"]
        assert test[1:3] == ["python", "-c"], name
        compile(test[3], f"{name} healthcheck", "exec")
        assert "\n" not in test[3]


def test_dockerfile_builds_torchjobs_on_python_311_slim() -> None:
    assert re.search(r"^FROM python:3\.11-slim\b", DOCKERFILE, re.M)
    pinned = re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE, re.M)
    assert pinned and 'pip install "torch==${TORCH_VERSION}"' in DOCKERFILE
    assert "CUDA" in DOCKERFILE, "the comment on CUDA builds of torch"
    project = (REPO / "pyproject.toml").read_text()
    torch_req = next(
        Requirement(line.strip().strip('",'))
        for line in project.splitlines()
        if line.strip().startswith('"torch')
    )
    assert torch_req.specifier.contains(pinned.group(1)), (torch_req, pinned.group(1))
    assert re.search(r"^RUN pip install -e \.", DOCKERFILE, re.M), "installs the project"


def test_dockerfile_runs_torchjobs() -> None:
    entrypoint = _exec_form("ENTRYPOINT")
    cmd = _exec_form("CMD")
    assert entrypoint == ["torchjobs"]
    assert cmd[0] == "server" and "0.0.0.0" in cmd
    assert re.search(r"^USER (?!root)\S+", DOCKERFILE, re.M), "does not run as root"


def _exec_form(instruction: str) -> list[str]:
    lines = re.findall(rf"^{instruction}\s+(.+)$", DOCKERFILE, re.M)
    assert len(lines) == 1, f"one {instruction}"
    value = lines[0].strip()
    return json.loads(value) if value.startswith("[") else shlex.split(value)


def _interpolated(arg: str) -> str:
    """Compose's `${VAR:-default}` with VAR unset; `${VAR:?msg}` must not appear in a command."""
    assert ":?" not in arg
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def test_a_wheel_carries_the_migrations_it_upgrades_to(tmp_path: Path) -> None:
    """A non-editable install (`pip install .`, a wheel) runs `torchjobs db upgrade`, `up`,
    `server` and `worker`: each needs migrations/ beside the service package."""
    import shutil
    import subprocess
    import sys
    import zipfile

    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("service", "workers", "migrations"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", "dist", "."],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = (source / "dist").glob("torchjobs-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    versions = {f"migrations/versions/{p.name}" for p in (REPO / "migrations" / "versions").glob("*.py")}
    assert versions and versions <= names
    assert {"migrations/env.py", "migrations/script.py.mako", "service/migrate.py"} <= names
