from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Boolean, Integer, String, true
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, UTCDateTime, utcnow


class Worker(Base):
    """A worker host as it announced itself; `session` changes on every process start."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    address: Mapped[str] = mapped_column(String(255))
    accelerator: Mapped[str] = mapped_column(String(8))
    gpus: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="online")
    session: Mapped[str] = mapped_column(String(64))
    last_heartbeat: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # the physical GPU behind each slot (its CUDA_VISIBLE_DEVICES entries); null: 0..gpus-1
    gpu_ids: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    # contract §7: "sandbox" or "none", how (or why not), and whether it takes every user's jobs
    isolation: Mapped[str] = mapped_column(String(16), default="none", server_default="none")
    isolation_detail: Mapped[str] = mapped_column(String(512), default="", server_default="")
    open_to_all: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # (v3) False: its multi-node jobs keep the host's network (a normal user's worker, whose
    # nodes cannot have networks of their own), so it takes the admin's multi-node jobs only
    multinode_open_to_all: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # (v3) its multi-node jobs' nodes get networks of their own (routed or private meshes): a
    # job's nodes all do, or none, or they never meet (the scheduler keeps them apart)
    meshes: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # contract §8: attempts in a row that ended in an infrastructure failure here, and why the
    # host takes no new work (None: it does). Not a `state`: it outlives restarts and silences.
    infra_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    quarantine_reason: Mapped[str | None] = mapped_column(String(512))
    # (v3) of those failures, the ones the job's own code could have caused, and the owners of
    # their jobs (at most two ids: two owners are what makes them count, service.hosts.health)
    job_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    job_failure_owners: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    # (v3, contract §14) the worker process's exec endpoint, HOST:PORT, and the secret the API
    # proves itself with there (a fresh one per process start; never shown by the API)
    exec_address: Mapped[str | None] = mapped_column(String(255), nullable=True)
    exec_secret: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # contract §12: an admin's drain (None: none): nothing new is placed here, what runs is
    # stopped as if preempted; "draining" while jobs hold slots here, then "drained"
    draining_since: Mapped[datetime | None] = mapped_column(UTCDateTime)


class DataVersion(Base):
    """A number bumped in the transaction that changes some data a process keeps a copy of:
    a write checked against it (`version = :seen`) fails, rather than acting on a stale copy.
    `hosts`: the set of registered hosts and their GPU counts and accelerators (bumped by
    `service.hosts.states.upsert_worker`), which `POST /v1/jobs` checks a job against."""

    __tablename__ = "data_versions"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, default=0)


class HostSubnet(Base):
    """A worker host's job subnet (contract §7 v3): a /24 of `TORCHJOBS_JOB_SUBNET_POOL` per
    host address, given once and kept, so that no two hosts of the cluster hand out the same
    job address (a multi-node job's nodes route to each other's: workers/node_mesh.py)."""

    __tablename__ = "host_subnets"

    address: Mapped[str] = mapped_column(String(255), primary_key=True)
    subnet: Mapped[str] = mapped_column(String(45), unique=True)
