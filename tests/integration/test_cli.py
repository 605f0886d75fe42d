"""The real `torchjobs` command against a real server: YAML specs, watch, download, JSON output."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.testing import harness
from service.testing.harness import Stack

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "digits-ddp.yaml"


def cli(stack: Stack, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHJOBS_")}
    env.update(
        TORCHJOBS_URL=stack.url, TORCHJOBS_TOKEN=harness.ADMIN_TOKEN, TORCHJOBS_HOME=str(stack.home / "cli")
    )
    exe = Path(sys.executable).parent / "torchjobs"
    return subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_submit_yaml_watch_download_and_json_output(embedded: Stack, tmp_path: Path) -> None:
    sub = cli(
        embedded,
        "submit",
        str(EXAMPLE),
        "--set",
        "hyperparameters.epochs=2",
        "--set",
        "name=cli-digits",
        "--output",
        "json",
    )
    assert sub.returncode == 0, sub.stderr
    job = json.loads(sub.stdout)
    assert job["name"] == "cli-digits" and job["hyperparameters"]["epochs"] == 2 and job["mode"] == "ddp"

    watch = cli(embedded, "watch", str(job["id"]))
    assert watch.returncode == 0, watch.stderr  # 0: the job succeeded
    assert "succeeded" in watch.stderr

    listed = json.loads(cli(embedded, "ls", "--output", "json").stdout)
    assert job["id"] in [j["id"] for j in listed["items"]]
    shown = json.loads(cli(embedded, "show", str(job["id"])).stdout)
    assert shown["state"] == "succeeded"

    ckpts = json.loads(cli(embedded, "checkpoints", str(job["id"]), "--output", "json").stdout)["items"]
    assert [c["epoch"] for c in ckpts] == [1, 2]
    dest = tmp_path / "final.pt"
    down = cli(embedded, "download", str(ckpts[-1]["id"]), "-o", str(dest), "--output", "json")
    assert down.returncode == 0, down.stderr
    result = json.loads(down.stdout)
    assert result["verified"] is True
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == ckpts[-1]["sha256"] == result["sha256"]


def test_validation_errors_are_shown_plainly_with_exit_2(embedded: Stack) -> None:
    bad = cli(embedded, "submit", str(EXAMPLE), "--set", "mode=single")
    assert bad.returncode == 2
    assert "gpus_per_node" in bad.stderr and "exactly 1 GPU" in bad.stderr
    unknown = cli(embedded, "show", "999999")
    assert unknown.returncode == 2 and "404" in unknown.stderr


@pytest.mark.parametrize(("script", "code"), [("fail.py", 1)])
def test_watch_exit_code_says_how_the_job_ended(embedded: Stack, script: str, code: int) -> None:
    sub = cli(
        embedded, "submit", "--set", "mode=single", "--set", f"entrypoint={{kind: script, path: {script}}}"
    )
    assert sub.returncode == 0, sub.stderr
    assert cli(embedded, "watch", sub.stdout.strip()).returncode == code


def test_url_and_token_may_come_before_the_command(embedded: Stack, tmp_path: Path) -> None:
    """`torchjobs --url U --token T ls`: nothing in the environment, no admin token file to
    fall back on, so the options given before the command are what reaches the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHJOBS_")}
    env["TORCHJOBS_HOME"] = str(tmp_path)
    exe = str(Path(sys.executable).parent / "torchjobs")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=60)

    ok = run("--url", embedded.url, "--token", harness.ADMIN_TOKEN, "ls", "-o", "json")
    assert ok.returncode == 0, ok.stderr
    assert isinstance(json.loads(ok.stdout), list | dict)
    wrong = run("--url", embedded.url, "--token", "tj_wrong", "ls")
    assert wrong.returncode == 2 and "401" in wrong.stderr
    after_wins = run("--url", embedded.url, "--token", "tj_wrong", "ls", "--token", harness.ADMIN_TOKEN)
    assert after_wins.returncode == 0, after_wins.stderr
    nobody = run("--url", f"http://127.0.0.1:{harness.free_port()}", "--token", "t", "ls")
    assert nobody.returncode == 2 and "could not reach http://127.0.0.1:" in nobody.stderr, nobody.stderr
    assert "Traceback" not in nobody.stderr


def test_the_admins_user_commands_and_usage(embedded: Stack) -> None:
    """Contract §9's CLI: add (the token once), ls, set-quota, set-priority, revoke; usage;
    and a submit that waits on another job with --depends-on."""
    added = cli(embedded, "users", "add", "carol", "--gpu-quota", "1")
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip()
    with embedded.client(token) as c:
        assert c.get("/v1/me").json()["name"] == "carol"
    listed = json.loads(cli(embedded, "users", "ls", "--output", "json").stdout)["items"]
    carol = next(u for u in listed if u["name"] == "carol")
    assert (carol["gpu_quota"], carol["max_priority"], carol["gpus_in_use"]) == (1, 0, 0)
    assert cli(embedded, "users", "set-quota", "carol", "none").returncode == 0
    assert cli(embedded, "users", "set-priority", "carol", "5").returncode == 0
    listed = json.loads(cli(embedded, "users", "ls", "-o", "json").stdout)["items"]
    carol = next(u for u in listed if u["name"] == "carol")
    assert (carol["gpu_quota"], carol["max_priority"]) == (None, 5)
    assert "carol" in cli(embedded, "users", "ls").stdout
    bad = cli(embedded, "users", "set-quota", "nobody", "2")
    assert bad.returncode != 0 and "no user named 'nobody'" in bad.stderr

    first = cli(embedded, "submit", "--model", "mlp", "--epochs", "1").stdout.strip()
    second = cli(
        embedded, "submit", "--model", "mlp", "--epochs", "1", "--depends-on", f"{first}:ended", "-o", "json"
    )
    assert json.loads(second.stdout)["depends_on"] == [{"job_id": int(first), "condition": "ended"}]
    assert cli(embedded, "watch", str(json.loads(second.stdout)["id"])).returncode == 0
    usage = json.loads(cli(embedded, "usage", "-o", "json").stdout)["items"]
    assert next(r for r in usage if r["user"] == "admin")["attempts"] >= 2  # (the stack is shared)
    assert "GPU-hours" in cli(embedded, "usage").stdout

    assert cli(embedded, "users", "revoke", "carol").returncode == 0
    with embedded.client(token) as c:
        assert c.get("/v1/me").status_code == 401


def test_the_webhook_commands(embedded: Stack) -> None:
    """Contract §10's webhooks from the CLI: add (a public address; loopback is refused
    without the setting), ls, deliveries, rm."""
    refused = cli(embedded, "webhooks", "add", "http://127.0.0.1:9/hook")
    assert refused.returncode != 0 and "loopback" in refused.stderr, refused.stderr
    added = cli(
        embedded, "webhooks", "add", "http://93.184.216.34/hook", "--events", "state,checkpoint", "-o", "json"
    )
    assert added.returncode == 0, added.stderr
    hook = json.loads(added.stdout)
    assert hook["events"] == ["state", "checkpoint"] and len(hook["secret"]) >= 16
    listed = cli(embedded, "webhooks", "ls", "-o", "json")
    assert any(h["id"] == hook["id"] and "secret" not in h for h in json.loads(listed.stdout)["items"])
    assert cli(embedded, "webhooks", "deliveries", str(hook["id"])).returncode == 0
    assert cli(embedded, "webhooks", "rm", str(hook["id"])).returncode == 0
    gone = cli(embedded, "webhooks", "rm", str(hook["id"]))
    assert gone.returncode != 0 and "not found" in gone.stderr, gone.stderr
