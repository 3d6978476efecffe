"""SQLAlchemy 2 ORM: the coordinator's tables.

Times the coordinator compares or buckets (``last_seen_ms``, ``reported_ms``, ...) are
integer Unix milliseconds, so the same arithmetic works on SQLite and PostgreSQL; times
shown to people (``created_at``) are timezone-aware datetimes.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, validates

# A run's status is part of the REST payloads both sides share.
from peer.formats.payloads import RunStatus as RunStatus
from server.services.display_names import comparison_key

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; use datetime.now(UTC)")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def table_of(model: type[Base]) -> Table:
    """The table ``model`` is mapped to, for Core statements (declarative types a model's
    ``__table__`` as any FromClause; every model here is declared on a Table)."""
    table = model.__table__
    assert isinstance(table, Table)
    return table


class TokenScope(enum.Enum):
    # A plain Enum: a str-based one would let the member ``join`` shadow ``str.join``.
    organizer = "organizer"
    join = "join"
    peer = "peer"


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    task: Mapped[str] = mapped_column(String(200))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[RunStatus] = mapped_column(
        Enum(RunStatus, name="run_status", native_enum=False, length=16)
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    archived_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The run authority: an Ed25519 key pair; the private half is AES-GCM encrypted with
    # a key derived from the server secret (see server.security).
    authority_public_key: Mapped[bytes] = mapped_column(LargeBinary(32))
    authority_private_key_encrypted: Mapped[bytes] = mapped_column(LargeBinary(128))
    last_snapshot_ms: Mapped[int] = mapped_column(BigInteger, default=0)
    # Set while the run waits (paused) for this many volunteers to be online; it starts by
    # itself when they are (server.services.runs), and the value is cleared once it started.
    min_volunteers: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The epoch at which the run finished by itself (its config's last); null when the
    # organizer finished it, or while it runs.
    finished_at_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The task file the run ships (its bytes in task_files, by digest) and the pip
    # requirements volunteers install for it; null when volunteers have the task installed.
    task_sha256: Mapped[str | None] = mapped_column(
        ForeignKey("task_files.sha256", ondelete="RESTRICT"), nullable=True
    )
    task_requirements: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)


class TaskFile(Base):
    """A task file shipped with runs, stored once by the SHA-256 of its bytes."""

    __tablename__ = "task_files"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    filename: Mapped[str] = mapped_column(String(200))
    size: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)  # read to serve it
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Token(Base):
    """A bearer token of one scope. Only the SHA-256 of the secret part is kept."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    scope: Mapped[TokenScope] = mapped_column(
        Enum(TokenScope, name="token_scope", native_enum=False, length=16)
    )
    secret_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    run_id: Mapped[str | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), nullable=True, index=True
    )
    peer_id: Mapped[int | None] = mapped_column(
        ForeignKey("peers.id", ondelete="CASCADE"), nullable=True
    )
    # A personal join token (made when a volunteer redeems an invite) joins as that volunteer.
    volunteer_id: Mapped[int | None] = mapped_column(
        ForeignKey("volunteers.id", ondelete="CASCADE"), nullable=True
    )
    label: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    max_uses: Mapped[int | None] = mapped_column(Integer, nullable=True)
    uses: Mapped[int] = mapped_column(Integer, default=0)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Volunteer(Base):
    """A person who joined a run through an invite; owns one or more peers."""

    __tablename__ = "volunteers"
    __table_args__ = (Index("ix_volunteers_run_id_name_key", "run_id", "name_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    display_name: Mapped[str] = mapped_column(String(64))
    # Equal for names a reader could take for one another (NFKC, case, UTS #39 skeleton):
    # server.services.display_names.comparison_key, kept in step with display_name below.
    # Null only for rows written around the ORM (a bulk insert), which collide with nothing.
    name_key: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # No foreign key: tokens reference peers, peers volunteers; this closes no cycle.
    join_token_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Set by an organizer's ban: the volunteer's tokens are revoked and its keys refused.
    banned_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    @validates("display_name")
    def _keep_name_key(self, _: str, value: str) -> str:
        self.name_key = comparison_key(value)
        return value


class Peer(Base):
    """A volunteer's node in one run, identified by its Ed25519 public key.

    The progress columns hold the peer's latest report, so the run's totals are one
    aggregate over this table rather than a scan of all reports.
    """

    __tablename__ = "peers"
    __table_args__ = (
        UniqueConstraint("run_id", "peer_id", name="uq_peers_run_id_peer_id"),
        Index("ix_peers_run_id_last_seen_ms", "run_id", "last_seen_ms"),
        # The dashboard sums each volunteer's peers.
        Index("ix_peers_volunteer_id", "volunteer_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    peer_id: Mapped[str] = mapped_column(String(64))
    public_key: Mapped[bytes] = mapped_column(LargeBinary(32))
    volunteer_id: Mapped[int] = mapped_column(ForeignKey("volunteers.id", ondelete="CASCADE"))
    addresses: Mapped[list[str]] = mapped_column(JSON)
    client_mode: Mapped[bool] = mapped_column(Boolean, default=False)
    first_seen_ms: Mapped[int] = mapped_column(BigInteger)
    last_seen_ms: Mapped[int] = mapped_column(BigInteger)
    # Latest report (null before the first one).
    last_report_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    samples: Mapped[int] = mapped_column(BigInteger, default=0)
    # Samples counted before the peer's counter last went backwards (a restart from zero):
    # the peer's contribution to the run is samples_base + samples.
    samples_base: Mapped[int] = mapped_column(BigInteger, default=0)
    samples_per_second: Mapped[float] = mapped_column(Float, default=0.0)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The latest report said the loss was NaN or infinite (``loss`` is then null).
    loss_nan: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    group_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The latest held-out metric the peer reported, and when (reports without one keep it).
    eval_metric: Mapped[float | None] = mapped_column(Float, nullable=True)
    eval_metric_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # the peer's latest claims: bytes its node sent (a counter beside ``samples``) and the
    # share of its loop's time spent computing since its previous report
    bytes_sent: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    compute_utilisation: Mapped[float | None] = mapped_column(Float, nullable=True)
    # When the coordinator last probed the peer's ports (rate limit shared by all workers).
    last_probe_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Time online: a session is a stretch of activity without a gap longer than the online
    # TTL; ``online_ms`` sums the closed ones, the open one began at ``session_started_ms``.
    session_started_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    online_ms: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Reports refused for breaking a plausibility bound, and the bound the last one broke.
    reports_refused: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    last_refusal: Mapped[str | None] = mapped_column(String(32), nullable=True)
    last_refusal_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # When the peer said it leaves (coordinator's clock); offline until heard from after it
    # (server.services.presence).
    left_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    volunteer: Mapped[Volunteer] = relationship(lazy="joined")


class ProgressReport(Base):
    """One report as a peer sent it: the raw record behind the summaries. Kept for
    ``report_retention_s`` (see server.services.retention), then folded into
    :class:`ReportRollup` rows and deleted."""

    __tablename__ = "progress_reports"
    __table_args__ = (
        Index("ix_progress_reports_run_id_id", "run_id", "id"),
        # The retention job walks the reports older than its cutoff in time order.
        Index("ix_progress_reports_reported_ms", "reported_ms"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    peer_id: Mapped[int] = mapped_column(ForeignKey("peers.id", ondelete="CASCADE"), index=True)
    reported_ms: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[int] = mapped_column(BigInteger)
    samples: Mapped[int] = mapped_column(BigInteger)
    samples_per_second: Mapped[float] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    group_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Averaging rounds since the peer's previous report, and why the last one failed.
    rounds_done: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    rounds_failed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    failure: Mapped[str | None] = mapped_column(String(64), nullable=True)
    eval_metric: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Already counted in a rollup: kept only because the recent group sizes still show it.
    rolled_up: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")


class ReportRollup(Base):
    """The reports of one peer within one time bucket, once past ``report_retention_s``:
    what a volunteer's chart and sessions need of them (server.services.rollups)."""

    __tablename__ = "report_rollups"

    peer_id: Mapped[int] = mapped_column(
        ForeignKey("peers.id", ondelete="CASCADE"), primary_key=True
    )
    bucket_ms: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    first_ms: Mapped[int] = mapped_column(BigInteger)
    last_ms: Mapped[int] = mapped_column(BigInteger)
    reports: Mapped[int] = mapped_column(BigInteger)
    first_samples: Mapped[int] = mapped_column(BigInteger)
    last_samples: Mapped[int] = mapped_column(BigInteger)
    # Samples banked by counter resets between the bucket's own reports.
    banked: Mapped[int] = mapped_column(BigInteger)


class Housekeeping(Base):
    """Rows the workers coordinate through. For a periodic job, when it is next due: a
    worker runs it only after moving ``due_ms`` on with a conditional UPDATE, so two workers
    never run it at once (server.services.retention). Others are locked with SELECT ... FOR
    UPDATE (``checkpoint_directory``, server.services.checkpoints)."""

    __tablename__ = "housekeeping"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    due_ms: Mapped[int] = mapped_column(BigInteger)


class SpilledSegment(Base):
    """How many lines of a spill file (reports acknowledged while the database was down,
    see server.services.report_spill) are written: advanced in the transaction that writes
    them, so each line is written exactly once."""

    __tablename__ = "spilled_segments"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    lines_done: Mapped[int] = mapped_column(BigInteger)


class EpochSummary(Base):
    """Aggregates over all reports of one epoch of one run (updated atomically per batch)."""

    __tablename__ = "epoch_summaries"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    first_report_ms: Mapped[int] = mapped_column(BigInteger)
    last_report_ms: Mapped[int] = mapped_column(BigInteger)
    reports: Mapped[int] = mapped_column(BigInteger)
    loss_sum: Mapped[float] = mapped_column(Float)
    loss_count: Mapped[int] = mapped_column(BigInteger)
    max_group_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    rounds_done: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    rounds_failed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class ProgressSnapshot(Base):
    """The run's totals at one instant, taken at most every ``snapshot_interval_s``;
    the chart history is these rows, downsampled."""

    __tablename__ = "progress_snapshots"
    __table_args__ = (Index("ix_progress_snapshots_run_id_taken_ms", "run_id", "taken_ms"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    taken_ms: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[int] = mapped_column(BigInteger)
    samples: Mapped[int] = mapped_column(BigInteger)
    samples_per_second: Mapped[float] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    peers_online: Mapped[int] = mapped_column(Integer)
    eval_metric: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Mean of the online peers' last averaging group sizes.
    mean_group_size: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The run's averaging rounds so far (cumulative).
    rounds_done: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    rounds_failed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class Checkpoint(Base):
    """A model checkpoint a peer uploaded; the file is ``<checkpoint_dir>/<run_id>/<filename>``.

    The coordinator never unpickles it: it only checks that it is a zip archive (what
    ``torch.save`` writes), hashes it and hands it out again.
    """

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "epoch", name="uq_checkpoints_run_id_epoch"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    epoch: Mapped[int] = mapped_column(BigInteger)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    filename: Mapped[str] = mapped_column(String(200))
    # The uploader's public peer id, as text: the record stands on its own.
    peer_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Set by the organizer: this one is served (downloads, joins) instead of the newest, and
    # never pruned. At most one per run.
    pinned_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class CheckpointProposal(Base):
    """A checkpoint's digest uploaded by a volunteer the run did not designate for that
    epoch: the file is not kept; a second volunteer's upload of the same digest is
    accepted. One per volunteer (its newest)."""

    __tablename__ = "checkpoint_proposals"

    volunteer_id: Mapped[int] = mapped_column(
        ForeignKey("volunteers.id", ondelete="CASCADE"), primary_key=True
    )
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_ms: Mapped[int] = mapped_column(BigInteger)
