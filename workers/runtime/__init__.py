"""torchjobs' in-rank library: the builtin trainer and what user scripts call.

Stands alone: the standard library, torch, numpy and scikit-learn only, never the service's web
stack, so that importing it in a rank is cheap and turns no rank into a database client.
Importing this package does not even import torch; `workers.runtime.trainer.train` does.
"""

from workers.runtime.errors import PREEMPTED_EXIT_CODE
from workers.runtime.events import report
from workers.runtime.marks import checkpoint_done

__all__ = ["PREEMPTED_EXIT_CODE", "checkpoint_done", "report"]
