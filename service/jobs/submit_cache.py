"""What `POST /v1/jobs` keeps between requests in one API process: who holds each token it has
seen, and the cluster's capacity that a job is checked against (#42: their reads were a fifth
of a submit's server CPU).

Nothing kept here is ever trusted on its own. The job's INSERT carries a guard (`WRITE_GUARD`)
that compares the copies with the tables in the very statement that writes the job: the
caller's row must still hold the token and every field the job was checked with, and the
hosts' version (`data_versions`, bumped by every registration that changes what a job is
checked against) must be the copy's. A token revoked, a user changed or a host re-registered
in any process, committed before that statement, makes it write nothing: the copies are
dropped, and the request is done again from the tables, exactly as without them (a 401 for a
revoked token, the 4xx or the job that the current rows give).

The job-view cache's change feed (`service.jobs.view_feed`) is not what keeps these honest: a
NOTIFY reaches the other processes after the commit, while a revoked token must be refused by
the very next request in every process, and this process's own commits clear that cache
(every submit would find its caller gone).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, and_
from sqlalchemy.orm import Session

from service.auth.tokens import user_for_token_hash
from service.errors import Unauthorized
from service.hosts import repository as hosts_repo
from service.jobs.states import WriteGuard
from service.models import User
from service.users import repository as users_repo

WRITE_GUARD = WriteGuard(and_(users_repo.CALLER_UNCHANGED, hosts_repo.CAPACITY_UNCHANGED))


@dataclass(frozen=True, slots=True)
class Caller:
    """The fields of a token's user that a submit reads (its name: the job view's owner)."""

    id: int
    name: str
    token_hash: str
    is_admin: bool
    max_priority: int
    gpu_quota: int | None

    @classmethod
    def of(cls, user: User, token_hash: str) -> Caller:
        return cls(user.id, user.name, token_hash, user.is_admin, user.max_priority, user.gpu_quota)

    def user(self) -> User:
        """A `User` with these fields, never added to a session: what the checks take."""
        return User(
            id=self.id,
            name=self.name,
            token_hash=self.token_hash,
            is_admin=self.is_admin,
            max_priority=self.max_priority,
            gpu_quota=self.gpu_quota,
        )

    def guard_params(self) -> dict[str, Any]:
        """The bind parameters of `users_repo.CALLER_UNCHANGED`."""
        return {
            "caller_id": self.id,
            "caller_token_hash": self.token_hash,
            "caller_name": self.name,
            "caller_is_admin": self.is_admin,
            "caller_max_priority": self.max_priority,
            "caller_gpu_quota": self.gpu_quota,
        }


@dataclass(frozen=True, slots=True)
class Cluster:
    """The registered hosts as a job is checked against them (`validation.check_fits_cluster`,
    `check_amp`), at `version` of `data_versions.hosts`."""

    version: int
    sizes: tuple[int, ...]  # each host's GPUs, largest first
    accelerators: frozenset[str]

    @classmethod
    def of(cls, version: int, hosts: Sequence[Row[int, str]]) -> Cluster:
        sizes = tuple(sorted((h.gpus for h in hosts), reverse=True))
        return cls(version, sizes, frozenset(h.accelerator for h in hosts))


def read_cluster(session: Session) -> Cluster | None:
    """The version first, then the hosts: a registration committed between the two reads
    leaves a copy newer than its version says, which fails its guard (the other order could
    keep an older copy under the newer version). None without a version row to check against."""
    version = hosts_repo.capacity_version(session)
    if version is None:
        return None
    return Cluster.of(version, hosts_repo.capacity(session))


@dataclass(frozen=True, slots=True)
class Submitter:
    """The caller of one request: from the process's copy (`user` None: not read this
    request), or read from the users table in this request's transaction."""

    caller: Caller
    user: User | None = None

    @property
    def verified(self) -> bool:
        return self.user is not None

    def checked_user(self) -> User:
        """The `User` the job is checked with: the row when it was read, else the copy's."""
        return self.user if self.user is not None else self.caller.user()


def fresh_user(session: Session, token_hash: str) -> User:
    """The token's user from the table, as `current_user` finds it: 401 when none holds it."""
    user = user_for_token_hash(session, token_hash)
    if user is None:
        raise Unauthorized()
    return user


class SubmitCache:
    """Thread-safe: requests of the thread pool read and store concurrently. Bounded: past
    `max_callers` tokens the oldest stored is dropped."""

    def __init__(self, max_callers: int = 4096) -> None:
        self.max_callers = max_callers
        self._callers: dict[str, Caller] = {}
        self._cluster: Cluster | None = None
        self._lock = threading.Lock()

    def caller(self, token_hash: str) -> Caller | None:
        return self._callers.get(token_hash)

    def store_caller(self, caller: Caller) -> None:
        with self._lock:
            if len(self._callers) >= self.max_callers and caller.token_hash not in self._callers:
                self._callers.pop(next(iter(self._callers)))
            self._callers[caller.token_hash] = caller

    @property
    def cluster(self) -> Cluster | None:
        return self._cluster

    def store_cluster(self, cluster: Cluster) -> None:
        self._cluster = cluster

    def forget(self, token_hash: str, cluster: Cluster) -> None:
        """A guard failed: the caller's copy or the cluster's is stale (which one is not known)."""
        with self._lock:
            self._callers.pop(token_hash, None)
            if self._cluster is cluster:
                self._cluster = None
