"""Coordinator settings: one pydantic-settings class, read from ``SWARMGRAD_*`` variables.

Build it once per process (the app factory and the CLI do) and pass it down; nothing in
``server`` reads the environment at import time.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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
        default="development",
        description="'production' refuses missing or placeholder secrets at start.",
    )
    database_url: str = Field(
        default="sqlite:///./swarmgrad.db",
        description="SQLAlchemy URL: a SQLite file (default) or postgresql+psycopg://...",
    )
    secret_key: SecretStr = Field(
        default=SecretStr(DEVELOPMENT_SECRET_KEY),
        description="Encrypts run signing keys at rest. Changing it makes existing runs unusable.",
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
    certificate_ttl_s: float = Field(
        default=24 * 3600.0, gt=0, description="Lifetime of a peer certificate issued at join."
    )
    join_token_default_ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    bootstrap_peers: int = Field(
        default=8, ge=1, le=100, description="Peers handed out per bootstrap."
    )
    history_points: int = Field(default=200, ge=2, le=5000, description="Points of chart history.")
    live_interval_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="How often a worker rereads a view that open pages watch live.",
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
    peer_auth_cache_ttl_s: float = Field(
        default=30.0,
        ge=0,
        description="How long a worker may reuse a verified peer token on the report path "
        "without asking the database: revoking it, or finishing its run, takes effect on "
        "reports within this time. 0 checks the database on every report.",
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
                "`python -c 'import secrets; print(secrets.token_urlsafe(48))'`."
            )
        warnings.warn(
            f"{message}; acceptable only because SWARMGRAD_ENVIRONMENT=development",
            stacklevel=2,
        )
        return self

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")
