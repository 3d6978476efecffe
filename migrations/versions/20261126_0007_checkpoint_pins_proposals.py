"""Checkpoints the organizer pins, and the digests volunteers not designated for an epoch
propose (accepted once a second volunteer uploads the same).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 23:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pinned_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "checkpoint_proposals",
        sa.Column("volunteer_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_checkpoint_proposals_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["volunteer_id"],
            ["volunteers.id"],
            name=op.f("fk_checkpoint_proposals_volunteer_id_volunteers"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("volunteer_id", name=op.f("pk_checkpoint_proposals")),
    )
    with op.batch_alter_table("checkpoint_proposals", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_checkpoint_proposals_run_id"), ["run_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("checkpoint_proposals", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoint_proposals_run_id"))
    op.drop_table("checkpoint_proposals")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_column("pinned_at")
