"""Report retention: per-bucket rollups of old raw reports, a flag on the raw reports the
recent group sizes still keep, and the housekeeping rows workers coordinate through (a
periodic job's due time, the checkpoint directory's lock).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 12:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("progress_reports", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("rolled_up", sa.Boolean(), server_default="0", nullable=False)
        )
        batch_op.create_index("ix_progress_reports_reported_ms", ["reported_ms"], unique=False)
    op.create_table(
        "report_rollups",
        sa.Column("peer_id", sa.Integer(), nullable=False),
        sa.Column("bucket_ms", sa.BigInteger(), nullable=False),
        sa.Column("first_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_ms", sa.BigInteger(), nullable=False),
        sa.Column("reports", sa.BigInteger(), nullable=False),
        sa.Column("first_samples", sa.BigInteger(), nullable=False),
        sa.Column("last_samples", sa.BigInteger(), nullable=False),
        sa.Column("banked", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["peer_id"],
            ["peers.id"],
            name=op.f("fk_report_rollups_peer_id_peers"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("peer_id", "bucket_ms", name=op.f("pk_report_rollups")),
    )
    op.create_table(
        "housekeeping",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("due_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_housekeeping")),
    )
    # Locked by checkpoint uploads under checkpoint_dir_max_bytes (server.services.checkpoints).
    op.execute(
        sa.table("housekeeping", sa.column("name", sa.String), sa.column("due_ms", sa.BigInteger))
        .insert()
        .values(name="checkpoint_directory", due_ms=0)
    )


def downgrade() -> None:
    op.drop_table("housekeeping")
    op.drop_table("report_rollups")
    with op.batch_alter_table("progress_reports", schema=None) as batch_op:
        batch_op.drop_index("ix_progress_reports_reported_ms")
        batch_op.drop_column("rolled_up")
