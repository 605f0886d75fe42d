"""When a failed delivery is tried again, and when it is given up: pure, clock passed in.

The wait before try n+1 after n failures is "equal jitter" over an exponential: with
e = min(max, initial * 2**(n-1)), a wait between e/2 and e — half of it fixed, so a receiver
that is down is not hammered, half random, so many deliveries that failed together do not
return together. Built from tenacity's own wait strategies (`wait_exponential` plus
`wait_random_exponential`, each on half the scale). tenacity's retry loop itself does not fit:
these retries outlive the process (they are rows in the outbox), so only its waits are used.

A delivery is given up after a failed try made `retry_for` or later after its event: it is
tried for at least that long (contract §10: at least an hour; the default is a day).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from tenacity import RetryCallState, Retrying, wait_exponential, wait_random_exponential


@dataclass(frozen=True)
class RetryPolicy:
    initial_s: float
    max_s: float
    retry_for_s: float

    def wait_s(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failed try (1 for the first)."""
        half_initial, half_max = self.initial_s / 2, self.max_s / 2
        wait = wait_exponential(multiplier=half_initial, max=half_max) + wait_random_exponential(
            multiplier=half_initial, max=half_max
        )
        state = RetryCallState(Retrying(), None, (), {})
        state.attempt_number = max(1, failures)
        return float(wait(state))

    def gives_up(self, created_at: datetime, now: datetime) -> bool:
        return now - created_at >= timedelta(seconds=self.retry_for_s)

    def next_try(self, failures: int, now: datetime) -> datetime:
        return now + timedelta(seconds=self.wait_s(failures))
