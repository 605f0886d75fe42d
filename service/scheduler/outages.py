"""When the scheduler last could not reach the database, so that silence is judged fairly.

A worker is lost when its heartbeats stop for `heartbeat_timeout_s`. While the database is
away (a restart, a fail-over), no heartbeat can land, from any worker: judged on the rows
alone, every worker would look lost the moment the database came back, and every running job
would be stopped and started again. So silence is judged only once this scheduler has
reached the database again for a whole timeout: time enough for every live worker to be heard.
A worker that the scheduler's own database cannot hear, while the scheduler can, is still lost
after the timeout, as before. A scheduler that has just started has not watched for a whole
timeout either (the database and the API may have been restarted together): it too waits one.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class DatabaseOutages:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.clock = timeout_s, clock
        self.away = False
        self.back_at = clock()  # the first pass that reached it after an outage (or the start)

    def unreachable(self) -> None:
        self.away = True

    def reached(self) -> None:
        if self.away:
            self.away, self.back_at = False, self.clock()

    def may_judge_silence(self) -> bool:
        if self.away:
            return False
        return self.clock() - self.back_at >= self.timeout_s
