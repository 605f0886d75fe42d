"""The GPU suite (issue #22): the builtin trainer and the launch plan on real CUDA devices.

It runs where CUDA is present and is reported as skipped elsewhere, never as passed. On a GPU
host, `bash .ci/gpu` runs it in one command: it needs Python with a CUDA build of torch,
pytest (with pytest-timeout), numpy and scikit-learn, not the service stack, because every
test here launches the real trainer under the real `torchrun`, as a worker does.
"""

from __future__ import annotations

import pytest

from tests.workers.runtime.conftest import Jobs


@pytest.fixture(scope="session")
def jobs() -> Jobs:
    return Jobs()
