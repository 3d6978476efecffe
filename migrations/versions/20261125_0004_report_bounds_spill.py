"""Refused reports per peer, progress of spilled report files, and banked samples that no
plausible peer can have reached are cleared.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 00:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MAX_INT = 2**53


def upgrade() -> None:
    with op.batch_alter_table("peers", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("reports_refused", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(sa.Column("last_refusal", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("last_refusal_ms", sa.BigInteger(), nullable=True))
    op.create_table(
        "spilled_segments",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("lines_done", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_spilled_segments")),
    )
    # Counter resets once banked without bound: such a base is no peer's work, and a sum
    # over it overflows and fails every write of the run.
    op.execute(
        sa.text("UPDATE peers SET samples_base = 0 WHERE samples_base > :max").bindparams(
            max=MAX_INT
        )
    )


def downgrade() -> None:
    op.drop_table("spilled_segments")
    with op.batch_alter_table("peers", schema=None) as batch_op:
        batch_op.drop_column("last_refusal_ms")
        batch_op.drop_column("last_refusal")
        batch_op.drop_column("reports_refused")
