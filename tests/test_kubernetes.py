"""deploy/kubernetes against the Kubernetes API schemas (kubernetes-validate ships them; no
cluster, no network), and against what torchjobs needs there: a migration Job, the API as a
Deployment with probes on /healthz, the workers as a DaemonSet on GPU nodes asking for
`nvidia.com/gpu` on the host network (the rendezvous), credentials only from the Secret, and
commands the CLI really has. Never applied to a cluster here: this environment has none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from service.cli.main import app

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
VERSIONS = ("1.30.0", "1.33.0")  # the oldest still maintained when this was written, and a newer


def documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    docs = []
    for name in [*kustomization["resources"], "secret.example.yaml"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_and_strict(version: str) -> None:
    docs = documents()
    assert len(docs) >= 10
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any unknown field


def test_the_kustomization_lists_every_manifest_but_the_example_secret() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert set(kustomization["resources"]) == files


def test_workers_are_a_daemonset_on_gpu_nodes_on_the_host_network() -> None:
    (worker,) = by_kind("DaemonSet")
    pod = worker["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (container,) = containers(worker)
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    args = container["args"]
    assert args[0] == "worker" and "--address=$(HOST_IP)" in args and "--accelerator=cuda" in args
    env = {e["name"]: e for e in container["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    gpus = next(a for a in args if a.startswith("--gpus="))
    assert gpus == f"--gpus={container['resources']['limits']['nvidia.com/gpu']}"


def test_the_api_runs_after_its_migration_with_probes() -> None:
    (job,) = by_kind("Job")
    assert containers(job)[0]["args"] == ["db", "upgrade"]
    api = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "torchjobs-api")
    (container,) = containers(api)
    assert container["args"][0] == "server"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert any(s["metadata"]["name"] == "torchjobs-api" for s in by_kind("Service"))


def test_credentials_come_only_from_the_secret() -> None:
    (secret,) = by_kind("Secret")
    keys = set(secret["stringData"])
    for doc in documents():
        if doc["kind"] not in ("Deployment", "DaemonSet", "Job", "StatefulSet"):
            continue
        for container in containers(doc):
            for env in container.get("env", []):
                name = env["name"]
                if any(word in name for word in ("PASSWORD", "TOKEN", "SECRET", "DATABASE_URL", "KEY")):
                    ref = env["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == "torchjobs" and ref["key"] in keys, (doc["metadata"]["name"], name)


@pytest.mark.parametrize("doc", ["Job", "Deployment", "DaemonSet"])
def test_the_commands_are_the_clis_own(doc: str) -> None:
    """Each torchjobs container's command parses with the real CLI (`--help` stops before it
    would run anything)."""
    for manifest in by_kind(doc):
        for container in containers(manifest):
            if container["image"] != "torchjobs":
                continue
            args = [
                a.replace("$(NODE_NAME)", "n").replace("$(HOST_IP)", "10.0.0.1") for a in container["args"]
            ]
            result = CliRunner().invoke(app, [*args, "--help"])
            assert result.exit_code == 0, (args, result.output)
