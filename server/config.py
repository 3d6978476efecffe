"""Coordinator settings: one pydantic-settings class, read from ``SWARMGRAD_*`` variables.

Build it once per process (the app factory and the CLI do) and pass it down; nothing in
``server`` reads the environment at import time.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
import warnings
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from peer.formats.payloads import DEFAULT_REPORT_INTERVAL_S

# Values that look like secrets but are not: copied from examples, left as defaults.
PLACEHOLDER_SECRETS = frozenset(
    {"", "changethis", "change-me", "changeme", "secret", "password", "admin", "dev", "development"}
)
DEVELOPMENT_SECRET_KEY = "changethis"
MIN_SECRET_LENGTH = 32


class InsecureSettingsError(ValueError):
    """A secret is missing or a placeholder outside development; the server must not start."""


class Settings(BaseSettings):
    """Everything an organizer can configure. Environment variables use the prefix
    ``SWARMGRAD_`` (``SWARMGRAD_DATABASE_URL``, ``SWARMGRAD_SECRET_KEY``, ...)."""

    model_config = SettingsConfigDict(
        env_prefix="SWARMGRAD_", env_file=None, extra="ignore", frozen=True
    )

    environment: Literal["development", "production"] = Field(
        default="production",
        description="'production' (the default) refuses missing or placeholder secrets at "
        "start; 'development' (`swarmgrad coordinator --dev`) only warns.",
    )
    database_url: str = Field(
        default="sqlite:///./swarmgrad.db",
        description="SQLAlchemy URL: a SQLite file (default) or postgresql+psycopg://...",
    )
    secret_key: SecretStr = Field(
        default=SecretStr(DEVELOPMENT_SECRET_KEY),
        description="Encrypts run signing keys at rest and signs join challenges. To change "
        "it, keep the old one in secret_key_previous until `swarmgrad coordinator rotate-key` "
        "has run.",
    )
    secret_key_previous: SecretStr | None = Field(
        default=None,
        description="The secret key before a rotation: run keys sealed under it still open "
        "and join challenges it signed are still accepted. Unset it once `swarmgrad "
        "coordinator rotate-key` has re-sealed every run key.",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="Optional organizer token accepted in addition to those in the database.",
    )
    public_url: str = Field(
        default="http://127.0.0.1:8000", description="Where volunteers reach this coordinator."
    )
    migrate_on_start: bool = Field(default=True, description="Apply Alembic migrations at start.")

    # Limits and timings.
    peer_online_ttl_s: float = Field(
        default=60.0, gt=0, description="A peer seen this recently is online."
    )
    report_interval_s: float = Field(
        default=DEFAULT_REPORT_INTERVAL_S,
        ge=1.0,
        le=60.0,
        description="How often volunteers report their progress (told at join): 10 s holds "
        "10,000 volunteers at 1,000 reports/s; a small run (the demo) may ask for more often.",
    )
    certificate_ttl_s: float = Field(
        default=24 * 3600.0, gt=0, description="Lifetime of a peer certificate issued at join."
    )
    peer_token_ttl_s: float = Field(
        default=14 * 24 * 3600.0,
        gt=0,
        le=366 * 24 * 3600,
        description="A peer token expires this long after the peer joined or last renewed "
        "its certificate; a volunteer away longer must join again with an invite. At least "
        "certificate_ttl_s, so that an active peer renews in time.",
    )
    join_token_default_ttl_s: float = Field(
        default=7 * 24 * 3600.0,
        gt=0,
        le=366 * 24 * 3600,
        description="Lifetime of an invite made without an expiry.",
    )
    join_token_default_max_uses: int = Field(
        default=100,
        ge=1,
        le=10_000_000,
        description="How many volunteers may join with an invite made without a limit.",
    )
    bootstrap_peers: int = Field(
        default=8, ge=1, le=100, description="Peers handed out per bootstrap."
    )
    relays: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="Relays (comma-separated relay://host:port, from `swarmgrad relay`) that "
        "volunteers no other peer can dial register with: told at join, so that pairs that "
        "cannot punch through their NATs still link. Empty: none.",
    )
    rendezvous_peers: int = Field(
        default=64,
        ge=1,
        le=1000,
        description="Peers behind NATs a punching peer is introduced to (the most recently "
        "seen first): the direct links each one keeps.",
    )
    history_points: int = Field(default=200, ge=2, le=5000, description="Points of chart history.")
    live_interval_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="How often a worker rereads a view that open pages watch live.",
    )
    dashboard_cache_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="How old the dashboard data served by the REST API (a run's, the runs "
        "list) may be before a read starts a new build in the background; the last one is "
        "served meanwhile, up to five times this old; 0 builds it for every request.",
    )
    snapshot_interval_s: float = Field(
        default=5.0, gt=0, description="Minimum time between two progress snapshots of one run."
    )
    report_flush_interval_s: float = Field(
        default=0.05,
        ge=0,
        description="Reports acknowledged with 202 are written within this time; 0 writes "
        "each report before answering.",
    )
    report_buffer_max: int = Field(
        default=2000, ge=1, description="Flush earlier once this many reports are waiting."
    )
    report_max_samples_per_second: float = Field(
        default=1e6,
        gt=0,
        description="The most samples per second any one peer of a run can process: a "
        "report claiming more, or a samples counter that grew faster since the peer "
        "joined, is refused (422).",
    )
    report_rate_multiple: float = Field(
        default=4.0,
        ge=1.0,
        description="A peer's samples earn credit at most this many times the median rate "
        "the coordinator measures for the run's other volunteers (a report over it is "
        "accepted, its counter credited up to it).",
    )
    report_rate_floor: float = Field(
        default=50_000.0,
        gt=0,
        description="Samples per second a peer earns credit for before any other volunteer "
        "of the run is measured (its first minutes, or a volunteer alone).",
    )
    report_max_epoch_lead: int = Field(
        default=100,
        ge=0,
        description="How far past the swarm's epoch a report may be (422 beyond).",
    )
    report_swarm_refresh_s: float = Field(
        default=5.0,
        gt=0,
        description="How old a worker's view of a run's epochs may be before a report "
        "that would be refused by the epoch bound makes it read them again.",
    )
    spill_dir: Path = Field(
        default=Path("./swarmgrad-spill"),
        description="Where acknowledged reports wait, on disk, while the database is "
        "unavailable; replayed when it returns, or by the next worker to start.",
    )
    report_retention_s: float | None = Field(
        default=7 * 24 * 3600.0,
        ge=3600,
        description="How long raw progress reports are kept. Older ones are folded into one "
        "row per peer and online-TTL bucket (volunteer charts and sessions keep their "
        "history) and deleted, except the newest reports behind each run's recent group "
        "sizes. Empty or 'none' keeps every report.",
    )
    report_retention_interval_s: float = Field(
        default=3600.0,
        ge=1,
        description="How often one of the workers folds and deletes reports past "
        "report_retention_s.",
    )
    peer_auth_cache_ttl_s: float = Field(
        default=600.0,
        ge=0,
        description="How long a worker may reuse a verified peer token on the report path "
        "(never past the token's expiry). 0 checks the database on every report.",
    )
    peer_auth_recheck_s: float = Field(
        default=2.0,
        gt=0,
        description="How often each worker asks the database which peer tokens were revoked "
        "and which runs finished, and stops reusing those: revoking a token, banning a "
        "volunteer or finishing a run takes effect on reports within this time.",
    )
    max_config_bytes: int = Field(
        default=64 * 1024, ge=2, description="Largest run config accepted."
    )
    db_pool_size: int = Field(default=10, ge=1)
    join_challenge_ttl_s: float = Field(
        default=120.0, gt=0, le=3600, description="How long a join challenge can be answered."
    )
    reachability_interval_s: float = Field(
        default=10.0, ge=0, description="Minimum time between two reachability probes of a peer."
    )
    reachability_timeout_s: float = Field(
        default=3.0, gt=0, le=60, description="How long a reachability probe waits to connect."
    )

    # The HTTP server `swarmgrad coordinator` runs (uvicorn; server.http_guard).
    http_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="A connection must send its request's headers within this long of "
        "opening, or of its previous response, or it is closed: idle and slow-header "
        "connections cannot pile up. Bodies (checkpoint uploads) are not bound by it.",
    )
    http_keep_alive_s: int = Field(
        default=5,
        ge=1,
        le=600,
        description="How long a connection may stay idle after a response before it closes.",
    )
    http_max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=16 * 1024 * 1024,
        description="Longest request line and headers accepted (431 beyond).",
    )
    http_max_connections: int = Field(
        default=1000,
        ge=1,
        description="Open connections per worker (WebSockets included); beyond, a new one "
        "is closed at once. Keep it under the process's descriptor limit (ulimit -n).",
    )
    http_max_pending_per_source: int = Field(
        default=32,
        ge=1,
        description="Connections from one address (an IPv6 network of "
        "rate_limit_ipv6_prefix bits) still waiting for their first request's headers; "
        "beyond, a new one is closed at once. Trusted proxies are exempt.",
    )

    # Rate limits: token buckets per worker process (docs/coordinator.md, "Rate limits").
    rate_limits: bool = Field(
        default=True, description="Refuse requests over the limits below with 429."
    )
    trusted_proxies: Annotated[tuple[str, ...], NoDecode] = Field(
        default=("127.0.0.1", "::1"),
        description="Addresses or networks (comma-separated) of reverse proxies whose "
        "X-Forwarded-For names the client; from any other address, the socket's peer is the "
        "client. Empty: trust none.",
    )
    rate_limit_join_per_s: float = Field(
        default=1.0, gt=0, description="Join challenges, and joins, per second per address."
    )
    rate_limit_join_burst: int = Field(default=60, ge=1)
    rate_limit_reports_per_s: float = Field(
        default=5.0, gt=0, description="Progress reports per second per peer token."
    )
    rate_limit_reports_burst: int = Field(
        default=300, ge=1, description="Above the 256 reports a peer queues while away."
    )
    rate_limit_peer_per_s: float = Field(
        default=0.5,
        gt=0,
        description="Bootstrap calls, and certificate renewals, per second per peer token.",
    )
    rate_limit_peer_burst: int = Field(default=20, ge=1)
    rate_limit_address_per_s: float = Field(
        default=100.0,
        gt=0,
        description="Reports, bootstrap calls and certificate renewals (each) per second per "
        "address, whatever the token: many volunteers may share one address (a NAT).",
    )
    rate_limit_address_burst: int = Field(default=1000, ge=1)
    rate_limit_dashboard_per_s: float = Field(
        default=10.0,
        gt=0,
        description="Reads of the dashboard's data and pages (the runs list, a run's "
        "dashboard, its volunteers' table, a volunteer's page) per second per address: a "
        "page open in a browser reads one every few seconds at most, while each read of "
        "another table page or volunteer is a database query.",
    )
    rate_limit_dashboard_burst: int = Field(default=100, ge=1)
    rate_limit_ipv6_prefix: int = Field(
        default=56,
        ge=32,
        le=128,
        description="An IPv6 client is counted with its whole network of this prefix length "
        "(per-address limits): a subscriber commonly holds a /56 or a /48, and could "
        "otherwise multiply its limits by changing addresses. 48 counts per /48, 64 per LAN.",
    )
    rate_limit_max_keys: int = Field(
        default=50_000,
        ge=1,
        description="Clients remembered per limit and worker; beyond, the least recently "
        "seen are forgotten (idle ones are forgotten anyway once their bucket is full).",
    )

    # Checkpoints.
    checkpoint_dir: Path = Field(
        default=Path("./swarmgrad-checkpoints"),
        description="Where uploaded checkpoints are kept, one directory per run. With several "
        "workers on several machines, a directory they all share.",
    )
    checkpoint_keep: int = Field(
        default=3, ge=1, description="Checkpoints kept per run; older ones are deleted."
    )
    checkpoint_max_bytes: int = Field(
        default=512 * 1024 * 1024, ge=1, description="Largest checkpoint accepted."
    )
    checkpoint_dir_max_bytes: int | None = Field(
        default=None,
        ge=1,
        description="Bound on the checkpoints kept in checkpoint_dir, all runs together: a "
        "new checkpoint that takes the total over it removes the oldest checkpoints first, "
        "but never a run's newest; one that cannot fit is refused (413 alone over the "
        "bound, else 507). Unset (the default), empty or 'none': only checkpoint_keep bounds "
        "the directory.",
    )

    @field_validator("report_retention_s", "checkpoint_dir_max_bytes", mode="before")
    @classmethod
    def _unset(cls, value: object) -> object:
        # SWARMGRAD_REPORT_RETENTION_S= (empty) or =none: no bound.
        if isinstance(value, str) and value.strip().lower() in ("", "none"):
            return None
        return value

    @field_validator("relays", "trusted_proxies", mode="before")
    @classmethod
    def _split_list(cls, value: object) -> object:
        # A list in one environment variable: comma-separated.
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("relays")
    @classmethod
    def _check_relays(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            parts = urllib.parse.urlsplit(entry)
            try:
                port = parts.port
            except ValueError:
                port = None
            if parts.scheme != "relay" or not parts.hostname or port is None or parts.path:
                raise ValueError(
                    f"SWARMGRAD_RELAYS: {entry!r} is not a relay address "
                    "(relay://host:port, as `swarmgrad relay` prints)"
                )
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _check_proxies(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"SWARMGRAD_TRUSTED_PROXIES: {entry!r} is not an IP address or network "
                    "(e.g. 10.0.0.5 or 10.0.0.0/8)"
                ) from None
        return value

    @model_validator(mode="after")
    def _check_lifetimes(self) -> Self:
        if self.peer_token_ttl_s < self.certificate_ttl_s:
            raise ValueError(
                f"SWARMGRAD_PEER_TOKEN_TTL_S ({self.peer_token_ttl_s:g} s) is shorter than "
                f"SWARMGRAD_CERTIFICATE_TTL_S ({self.certificate_ttl_s:g} s): peer tokens "
                "would expire before their peers renew a certificate"
            )
        return self

    @model_validator(mode="after")
    def _check_secrets(self) -> Self:
        problems = []
        secret = self.secret_key.get_secret_value()
        if secret.lower() in PLACEHOLDER_SECRETS or len(secret) < MIN_SECRET_LENGTH:
            problems.append(
                f"SWARMGRAD_SECRET_KEY is missing, a placeholder or shorter than "
                f"{MIN_SECRET_LENGTH} characters"
            )
        if self.admin_token is not None:
            token = self.admin_token.get_secret_value()
            if token.lower() in PLACEHOLDER_SECRETS or len(token) < MIN_SECRET_LENGTH:
                problems.append(
                    f"SWARMGRAD_ADMIN_TOKEN is a placeholder or shorter than "
                    f"{MIN_SECRET_LENGTH} characters (unset it, or use e.g. "
                    "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
                )
        if not problems:
            return self
        message = "; ".join(problems)
        if self.environment != "development":
            raise InsecureSettingsError(
                f"refusing to start in {self.environment}: {message}. Generate a secret with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(48))'`, or try it "
                "out in development mode (`swarmgrad coordinator --dev`)."
            )
        warnings.warn(
            f"{message}; acceptable only because SWARMGRAD_ENVIRONMENT=development",
            stacklevel=2,
        )
        return self

    def secret_keys(self) -> tuple[str, str | None]:
        """The secret key and, during a rotation, the previous one."""
        previous = self.secret_key_previous
        return (
            self.secret_key.get_secret_value(),
            None if previous is None else previous.get_secret_value(),
        )

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")
