"""When a peer said it leaves: a volunteer that stops cleanly shows offline at once.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27 03:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("peers") as batch:
        batch.add_column(sa.Column("left_ms", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("peers") as batch:
        batch.drop_column("left_ms")
