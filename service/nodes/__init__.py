"""The node seam: the one API that code on a GPU host (`workers/`) may call on the control plane.

- `values.py`: plain values a node is given and reports (`NodeKey`, `NodeOutcome`, `Batch`,
  `JobControl`, `NodeLimits`); no database import, so the launcher loads it beside torchrun.
- `claims.py`: claim a node for launch, record its end.
- `reports.py`: a running node's batches of logs and progress, its events, the job's control.
- `checkpoints.py`: store a rank's checkpoint.
- `hosts.py`: a worker host's registration, heartbeats and going offline.
- `code.py`: where a job's code archive is stored, how it is unpacked, a script's real path.
- `wire.py`: the Celery wire: the task's name and arguments, queue naming, broker options.

The modules only name what lives in the domain folders (`service.jobs`, `service.hosts`, ...);
the logic stays there. `tests/test_boundaries.py` holds `workers/` to this package and the core
modules. This file stays empty: importing `service.nodes.values` must not load the rest.
"""
