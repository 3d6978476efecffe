"""Rounds and held-out metric in reports, reachability probes, checkpoints.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 20:15:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("peers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("eval_metric", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("eval_metric_ms", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("last_probe_ms", sa.BigInteger(), nullable=True))

    with op.batch_alter_table("progress_reports", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("rounds_done", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column("rounds_failed", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(sa.Column("failure", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("eval_metric", sa.Float(), nullable=True))

    with op.batch_alter_table("epoch_summaries", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("rounds_done", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column("rounds_failed", sa.BigInteger(), server_default="0", nullable=False)
        )

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("filename", sa.String(length=200), nullable=False),
        sa.Column("peer_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("run_id", "epoch", name="uq_checkpoints_run_id_epoch"),
    )


def downgrade() -> None:
    op.drop_table("checkpoints")
    with op.batch_alter_table("epoch_summaries", schema=None) as batch_op:
        batch_op.drop_column("rounds_failed")
        batch_op.drop_column("rounds_done")

    with op.batch_alter_table("progress_reports", schema=None) as batch_op:
        batch_op.drop_column("eval_metric")
        batch_op.drop_column("failure")
        batch_op.drop_column("rounds_failed")
        batch_op.drop_column("rounds_done")

    with op.batch_alter_table("peers", schema=None) as batch_op:
        batch_op.drop_column("last_probe_ms")
        batch_op.drop_column("eval_metric_ms")
        batch_op.drop_column("eval_metric")
