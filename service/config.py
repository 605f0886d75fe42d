"""The one place configuration is read (contract §1).

Every server-side process of torchjobs — API server, scheduler, workers, the admin CLI —
builds a `Settings` from the environment (prefix ``TORCHJOBS_``, an optional ``.env``) and
passes it down. The client, which runs on a laptop without the server, reads the four values it
needs from the same variables with its own `service.client.settings.ClientSettings`
(`tests/service/test_client_settings.py` checks the two agree). Nothing else reads
``os.environ`` for torchjobs settings.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TORCHJOBS_", env_file=".env", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".torchjobs")
    database_url: str | None = None
    # Behind PgBouncer in transaction mode: no server-side prepared statements (a pooled
    # server connection serves other clients between transactions), and LISTEN (the job-view
    # cache's change feed) only on `database_direct_url`; without it that cache stays off.
    database_pooled: bool = False
    database_direct_url: str | None = None
    broker_url: str | None = None
    storage_url: str | None = None
    # fsspec options for the storage URL, as JSON in TORCHJOBS_STORAGE_OPTIONS, e.g.
    # {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}} for an S3-compatible server.
    storage_options: dict[str, Any] = Field(default_factory=dict)
    admin_token: str | None = None
    script_roots: str = ""
    url: str = "http://127.0.0.1:8000"
    token: str | None = None

    # 5 s: a thousand hosts cost 200 commits a second, not 500 (bench/scale.py); a host is
    # still judged after three missed beats
    heartbeat_interval_s: float = 5.0
    heartbeat_timeout_s: float = 15.0
    quarantine_after: int = Field(3, ge=0)  # infrastructure failures in a row on a host (0: never)
    scheduler_interval_s: float = 1.0
    # between passes while no job waits (nothing queued, cancelling or unclaimed): a running
    # job's host is spared a transaction a second; a lost worker is seen up to this much later
    scheduler_idle_interval_s: float = 5.0
    starvation_s: float = 300.0
    # contract §12: an elastic job grows at most once this often (a lost node resizes at once)
    resize_interval_s: float = Field(300.0, ge=0)
    # the queue's counts (queue positions) checked against the queue itself this often (0: never)
    queue_recount_s: float = Field(600.0, ge=0)
    cancel_grace_s: float = 10.0
    rendezvous_timeout_s: float = 120.0
    # a node still running this long after every other node of its attempt ended is stalled
    peer_exit_timeout_s: float = Field(120.0, gt=0)
    preflight_timeout_s: float = Field(60.0, gt=0)
    warm_agent: bool = True  # keep one torchrun agent waiting with torch imported
    # a warm spare sandbox (CPU workers) also forks its node's ranks from a process that has
    # imported torch and taken a first step (workers/runtime/warm_rank_server.py)
    warm_ranks: bool = True
    # Walls between users (contract §7, workers/launcher/sandbox.py): "auto" sandboxes ranks
    # whenever the worker can, "off" never does (the worker then says isolation "none").
    sandbox: Literal["auto", "off"] = "auto"
    sandbox_user: str = "torchjobs-run"  # a root worker's ranks run as this user (else nobody)
    # (contract §7 v3) "auto": "routed" where the worker can give it (root, sandboxed,
    # nftables that takes its table), else "private", said at start; "private": a job node's
    # sandbox has a network namespace of its own (a
    # single-node job's ranks meet on its own loopback; a multi-node job's nodes, on a root
    # worker, over a veth each with a route to each other and to nothing else; no host service,
    # no other job, and no route out); "routed": the same namespaces, the world routed and
    # masqueraded and the host, other jobs and private ranges walled (a root worker with
    # nftables: workers/launcher/job_network.py); "host": every job on the host's network, as
    # before v3 (docs/security.md, "Network").
    job_network: Literal["auto", "private", "routed", "host"] = "auto"
    # this host's job subnet (a /30 of it per job node); unset: the control plane gives each
    # host address a /24 of the pool (service/hosts/subnets.py), unique in the cluster
    job_subnet: str | None = None
    job_subnet_pool: str = "10.213.0.0/16"
    job_network_allow: str = ""  # "routed": CIDR or CIDR:PORT, comma-separated, opened in the walled ranges
    job_network_dns: bool = True  # "routed": names resolved through the worker's relay (dns_relay.py)
    # a root worker's job nodes each run as a uid of their own from this range (never reused
    # while a process of it lives; workers/launcher/uids.py); "off": all as sandbox_user
    job_uids: str = "2000000000-2099999999"
    allow_unisolated: bool = False  # an unsandboxed worker takes every user's jobs, not the admin's only
    # a worker whose multi-node jobs keep the host's network (a normal user's: no veths) takes
    # every user's multi-node jobs, not the admin's only (their ranks reach the host's services)
    allow_host_network: bool = False
    # host folders or files every sandbox binds read-only, comma-separated absolute paths: NCCL
    # network plugins and the libraries they load (with LD_LIBRARY_PATH in rank_env_allow)
    sandbox_binds: str = ""
    # the worker's own variables that reach ranks: names, or prefixes ending in "*"; never
    # TORCHJOBS_*, AWS_* or the like, whatever this says (workers/launcher/command.py)
    rank_env_allow: str = (
        "OMP_NUM_THREADS,MKL_NUM_THREADS,NCCL_*,GLOO_*,CUDA_DEVICE_ORDER,CUDA_MODULE_LOADING"
    )
    redispatch_after_s: float = 10.0
    cache_max_bytes: int = 20 * 1024**3
    master_port_base: int = 29400
    master_port_span: int = 2000
    max_request_bytes: int = 1_048_576
    max_upload_bytes: int = 8 * 1024**3
    # Code archives (contract §6): compressed (a 413 past it), then unpacked bytes and members (422)
    max_code_bytes: int = Field(256 * 1024**2, ge=1)
    max_code_unpacked_bytes: int = Field(2 * 1024**3, ge=1)
    max_code_members: int = Field(100_000, ge=1)
    code_cache_max_bytes: int = 10 * 1024**3  # a worker's unpacked code, least recently used out first
    # environment.pip (contract §6), built with uv on each worker host
    env_cache_max_bytes: int = 20 * 1024**3
    env_build_timeout_s: float = 900.0
    env_installer_args: str = ""  # extra uv arguments, e.g. "--find-links /opt/wheels" or an index URL
    checkpoint_keep_last: int = Field(0, ge=0)  # per job; 0 keeps every checkpoint
    # contract §11: a folder checkpoint with no mark of completion is complete once nothing
    # beneath it changed for this long
    checkpoint_settle_s: float = Field(10.0, gt=0, le=86400)
    upload_validate_timeout_s: float = 300.0  # the subprocess that loads an upload with weights_only
    metrics_public: bool = False
    log_json: bool = False

    # Live streams (service.streams, service.wakeups)
    sse_ping_s: float = 15.0  # ": ping" comment on an idle stream
    # embedded setup (no Redis): one shared check this often while streams are open (a stored
    # event then reaches its streams within about this long; issue 26 asks p99 < 0.3 s)
    stream_poll_s: float = Field(0.1, gt=0)
    stream_recheck_s: float = 10.0  # every stream re-reads this often even without a wake-up
    stream_read_concurrency: int = 8  # database reads in flight for all streams together
    logs_page_bytes: int = 1_048_576  # most bytes one GET .../logs answers
    # each rank's stored log, per attempt (contract §7 v3): past it, a line says where it was cut
    log_max_mb: float = Field(100.0, gt=0)
    # each job node's control groups (contract §7 v3, workers/launcher/cgroups.py): processes
    # and threads, and memory with shared memory per GPU of the node (None: the host's memory
    # divided by the worker's GPUs); past either the job fails, naming the limit
    job_pids_max: int = Field(8192, ge=16)
    memory_per_gpu_mb: int | None = Field(None, gt=0)
    # bytes a job node keeps under its run folder and TMPDIR, per GPU (workers/launcher/disk.py)
    job_disk_max_mb: int = Field(102400, gt=0)

    # Into a running job (contract §14, workers/exec_endpoint.py): where each worker's exec
    # endpoint listens ("" = the worker's --address; "0.0.0.0" = every interface) and on which
    # port (0: any free one; the row in `workers` says which); sessions open at once per user
    # and per job (past either a 429), counted by each API process
    exec_bind: str = ""
    exec_port: int = Field(0, ge=0, le=65535)
    exec_max_per_user: int = Field(8, ge=1)
    exec_max_per_job: int = Field(8, ge=1)
    exec_connect_timeout_s: float = Field(10.0, gt=0)  # the API's connection to a worker's endpoint

    # GET /v1/jobs/{id} from memory while a change feed runs (service.jobs.view_cache); 0: off
    job_view_cache_ttl_s: float = Field(5.0, ge=0)

    # Webhooks (contract §10, service.webhooks): targets on loopback, link-local or private
    # addresses are refused unless allowed; a delivery is retried, with exponential backoff
    # from `webhook_backoff_initial_s` up to `webhook_backoff_max_s` between tries, until
    # `webhook_retry_for_s` after its event (at least an hour), then given up.
    webhook_allow_private: bool = False
    webhook_retry_for_s: float = Field(86400.0, ge=3600)
    webhook_backoff_initial_s: float = Field(1.0, gt=0)
    webhook_backoff_max_s: float = Field(300.0, gt=0)
    webhook_poll_s: float = Field(1.0, gt=0)  # the dispatcher's look for due deliveries
    webhook_timeout_s: float = Field(10.0, gt=0)  # connect, send and answer, each
    webhook_concurrency: int = Field(4, ge=1, le=64)  # (webhook, job) pairs sent at once per process
    webhooks_per_user: int = Field(20, ge=0)

    @cached_property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'torchjobs.db'}"

    @cached_property
    def resolved_broker_url(self) -> str:
        """The embedded broker is kombu's filesystem transport: no server to run."""
        return self.broker_url or "filesystem://"

    @property
    def broker_folder(self) -> Path:
        return self.home / "broker"

    @cached_property
    def resolved_storage_url(self) -> str:
        return self.storage_url or f"file://{self.home / 'checkpoints'}"

    @property
    def admin_token_file(self) -> Path:
        return self.home / "admin.token"

    @property
    def logs_dir(self) -> Path:
        """`torchjobs up`'s component logs (api.log, worker.log), unless run with --verbose."""
        return self.home / "logs"

    @property
    def runs_dir(self) -> Path:
        """Per-node working folders of running attempts; each is removed when its node ends."""
        return self.home / "runs"

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    @cached_property
    def sandbox_bind_paths(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.sandbox_binds.split(",") if p.strip())

    @field_validator("sandbox_binds")
    @classmethod
    def _absolute_binds(cls, value: str) -> str:
        for path in (p.strip() for p in value.split(",") if p.strip()):
            if not path.startswith("/") or ".." in Path(path).parts:
                raise ValueError(f"TORCHJOBS_SANDBOX_BINDS: {path!r} is not an absolute path without '..'")
        return value

    @cached_property
    def script_root_paths(self) -> list[Path]:
        return [Path(p).resolve() for p in self.script_roots.split(":") if p.strip()]

    @property
    def is_sqlite(self) -> bool:
        return self.resolved_database_url.startswith("sqlite")


def get_settings() -> Settings:
    return Settings()
