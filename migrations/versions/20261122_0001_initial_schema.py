"""Initial schema: runs, tokens, volunteers, peers, progress reports, summaries, snapshots.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 06:25:24.820671
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("task", sa.String(length=200), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "running", "paused", "finished", name="run_status", native_enum=False, length=16
            ),
            nullable=False,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("archived_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("authority_public_key", sa.LargeBinary(length=32), nullable=False),
        sa.Column("authority_private_key_encrypted", sa.LargeBinary(length=128), nullable=False),
        sa.Column("last_snapshot_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_table(
        "epoch_summaries",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("first_report_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_report_ms", sa.BigInteger(), nullable=False),
        sa.Column("reports", sa.BigInteger(), nullable=False),
        sa.Column("loss_sum", sa.Float(), nullable=False),
        sa.Column("loss_count", sa.BigInteger(), nullable=False),
        sa.Column("max_group_size", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_epoch_summaries_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "epoch", name=op.f("pk_epoch_summaries")),
    )
    op.create_table(
        "progress_snapshots",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("taken_ms", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("samples_per_second", sa.Float(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("peers_online", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_progress_snapshots_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_progress_snapshots")),
    )
    with op.batch_alter_table("progress_snapshots", schema=None) as batch_op:
        batch_op.create_index(
            "ix_progress_snapshots_run_id_taken_ms", ["run_id", "taken_ms"], unique=False
        )

    op.create_table(
        "volunteers",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("display_name", sa.String(length=64), nullable=False),
        sa.Column("join_token_id", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_volunteers_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_volunteers")),
    )
    with op.batch_alter_table("volunteers", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_volunteers_run_id"), ["run_id"], unique=False)

    op.create_table(
        "peers",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("peer_id", sa.String(length=64), nullable=False),
        sa.Column("public_key", sa.LargeBinary(length=32), nullable=False),
        sa.Column("volunteer_id", sa.Integer(), nullable=False),
        sa.Column("addresses", sa.JSON(), nullable=False),
        sa.Column("client_mode", sa.Boolean(), nullable=False),
        sa.Column("first_seen_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_seen_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_report_ms", sa.BigInteger(), nullable=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("samples_base", sa.BigInteger(), nullable=False),
        sa.Column("samples_per_second", sa.Float(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("group_size", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_peers_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["volunteer_id"],
            ["volunteers.id"],
            name=op.f("fk_peers_volunteer_id_volunteers"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_peers")),
        sa.UniqueConstraint("run_id", "peer_id", name="uq_peers_run_id_peer_id"),
    )
    with op.batch_alter_table("peers", schema=None) as batch_op:
        batch_op.create_index(
            "ix_peers_run_id_last_seen_ms", ["run_id", "last_seen_ms"], unique=False
        )

    op.create_table(
        "progress_reports",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("peer_id", sa.Integer(), nullable=False),
        sa.Column("reported_ms", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("samples_per_second", sa.Float(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("group_size", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["peer_id"],
            ["peers.id"],
            name=op.f("fk_progress_reports_peer_id_peers"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_progress_reports_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_progress_reports")),
    )
    with op.batch_alter_table("progress_reports", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_progress_reports_peer_id"), ["peer_id"], unique=False)
        batch_op.create_index("ix_progress_reports_run_id_id", ["run_id", "id"], unique=False)

    op.create_table(
        "tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column(
            "scope",
            sa.Enum("organizer", "join", "peer", name="token_scope", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("secret_hash", sa.LargeBinary(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=True),
        sa.Column("peer_id", sa.Integer(), nullable=True),
        sa.Column("label", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("max_uses", sa.Integer(), nullable=True),
        sa.Column("uses", sa.Integer(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["peer_id"], ["peers.id"], name=op.f("fk_tokens_peer_id_peers"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_tokens_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
    )
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tokens_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tokens_run_id"))

    op.drop_table("tokens")
    with op.batch_alter_table("progress_reports", schema=None) as batch_op:
        batch_op.drop_index("ix_progress_reports_run_id_id")
        batch_op.drop_index(batch_op.f("ix_progress_reports_peer_id"))

    op.drop_table("progress_reports")
    with op.batch_alter_table("peers", schema=None) as batch_op:
        batch_op.drop_index("ix_peers_run_id_last_seen_ms")

    op.drop_table("peers")
    with op.batch_alter_table("volunteers", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_volunteers_run_id"))

    op.drop_table("volunteers")
    with op.batch_alter_table("progress_snapshots", schema=None) as batch_op:
        batch_op.drop_index("ix_progress_snapshots_run_id_taken_ms")

    op.drop_table("progress_snapshots")
    op.drop_table("epoch_summaries")
    op.drop_table("runs")
