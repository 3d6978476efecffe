"""Personal join tokens, bans, peers' time online, richer progress snapshots.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 00:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("volunteer_id", sa.Integer(), nullable=True))
        batch_op.create_foreign_key(
            batch_op.f("fk_tokens_volunteer_id_volunteers"),
            "volunteers",
            ["volunteer_id"],
            ["id"],
            ondelete="CASCADE",
        )

    with op.batch_alter_table("volunteers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("banned_at", sa.DateTime(timezone=True), nullable=True))

    with op.batch_alter_table("peers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("session_started_ms", sa.BigInteger(), nullable=True))
        batch_op.add_column(
            sa.Column("online_ms", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(sa.Column("loss_nan", sa.Boolean(), server_default="0", nullable=False))
        batch_op.create_index("ix_peers_volunteer_id", ["volunteer_id"], unique=False)

    with op.batch_alter_table("progress_snapshots", schema=None) as batch_op:
        batch_op.add_column(sa.Column("eval_metric", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("mean_group_size", sa.Float(), nullable=True))
        batch_op.add_column(
            sa.Column("rounds_done", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column("rounds_failed", sa.BigInteger(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("progress_snapshots", schema=None) as batch_op:
        batch_op.drop_column("rounds_failed")
        batch_op.drop_column("rounds_done")
        batch_op.drop_column("mean_group_size")
        batch_op.drop_column("eval_metric")

    with op.batch_alter_table("peers", schema=None) as batch_op:
        batch_op.drop_index("ix_peers_volunteer_id")
        batch_op.drop_column("loss_nan")
        batch_op.drop_column("online_ms")
        batch_op.drop_column("session_started_ms")

    with op.batch_alter_table("volunteers", schema=None) as batch_op:
        batch_op.drop_column("banned_at")

    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.drop_constraint(
            batch_op.f("fk_tokens_volunteer_id_volunteers"), type_="foreignkey"
        )
        batch_op.drop_column("volunteer_id")
