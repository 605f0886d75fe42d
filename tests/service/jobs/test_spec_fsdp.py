"""`mode: fsdp` in the job spec (contract §11): one process per GPU like ddp, on any number of
nodes; the other one-node modes still refuse nodes > 1."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.jobs.spec import JobSpec

BUILTIN = {"kind": "builtin", "model": "cnn", "dataset": "digits"}


@pytest.mark.parametrize(("nodes", "gpus"), [(1, 1), (1, 4), (3, 2)])
def test_fsdp_is_accepted_on_one_node_and_on_several(nodes: int, gpus: int) -> None:
    spec = JobSpec.model_validate(
        {"mode": "fsdp", "nodes": nodes, "gpus_per_node": gpus, "entrypoint": BUILTIN}
    )
    assert (spec.mode, spec.nodes, spec.gpus_per_node) == ("fsdp", nodes, gpus)


def test_fsdp_still_needs_a_gpu_per_node() -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"mode": "fsdp", "gpus_per_node": 0, "entrypoint": BUILTIN})
    assert info.value.errors()[0]["loc"] == ("gpus_per_node",)


def test_one_node_modes_name_both_multi_node_modes() -> None:
    with pytest.raises(ValidationError, match="only 'ddp' and 'fsdp' may use nodes > 1"):
        JobSpec.model_validate({"mode": "dp", "nodes": 2, "entrypoint": BUILTIN})
