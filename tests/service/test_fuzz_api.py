"""schemathesis against the running server's own OpenAPI schema, as the admin: all default
checks, stateful links included, and hypothesis over the job spec.

One check is left out, and only one: `positive_data_acceptance`. The contract requires a 422
for specs that are valid JSON-schema-wise but contradict the cluster or the settings (a script
outside the roots, a checkpoint that is not yours, more GPUs than any worker has): a JSON
schema cannot express those, so "schema-valid" does not mean "acceptable" here.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.testing import harness
from service.testing.harness import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, module_pg_url: str) -> Iterator[Stack]:
    """No worker: whatever the fuzzer submits is judged by the API and then only waits."""
    home = Path(tmp_path_factory.mktemp("fuzz"))
    env = harness.make_env(home, TORCHJOBS_DATABASE_URL=module_pg_url)
    subprocess.run(harness.torchjobs_cmd("db", "upgrade"), env=env, check=True, capture_output=True)
    s = Stack(home=home, env=env, port=harness.free_port(), embedded=False)
    s.start_server()
    yield s
    s.stop()


def test_schemathesis_finds_no_server_error_and_no_schema_violation(stack: Stack, tmp_path: Path) -> None:
    cmd = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{stack.url}/openapi.json",
        "-H",
        f"Authorization: Bearer {harness.ADMIN_TOKEN}",
        "--exclude-checks",
        "positive_data_acceptance",
        "--max-examples",
        "25",
        "--seed",
        "1",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "Server error" not in result.stdout


spec_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
spec_like = st.fixed_dictionaries(
    {},
    optional={
        "mode": st.sampled_from(["single", "dp", "ddp", "tpu", 1]),
        "nodes": spec_values,
        "gpus_per_node": spec_values,
        "entrypoint": st.fixed_dictionaries(
            {"kind": st.sampled_from(["builtin", "factory", "script", "shell"])},
            optional={"model": spec_values, "dataset": spec_values, "path": spec_values, "args": spec_values},
        ),
        "hyperparameters": spec_values,
        "resume_from": spec_values,
        "env": spec_values,
        "labels": spec_values,
        "priority": spec_values,
        "max_retries": spec_values,
        "name": spec_values,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=spec_like)
def test_any_spec_is_accepted_or_refused_cleanly(stack: Stack, spec: dict) -> None:
    resp = httpx.post(
        f"{stack.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {harness.ADMIN_TOKEN}"}
    )
    assert resp.status_code in (201, 422), resp.text
    body = resp.json()
    if resp.status_code == 201:
        assert body["state"] == "queued" and body["mode"] == spec["mode"]
    else:
        assert isinstance(body["detail"], list) and body["detail"][0]["loc"][0] == "body"
