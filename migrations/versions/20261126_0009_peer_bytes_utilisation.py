"""Peers' latest claims of bytes sent and compute utilisation (shown as the run's bytes per
sample and each volunteer's compute utilisation).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 23:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("peers") as batch:
        batch.add_column(sa.Column("bytes_sent", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("compute_utilisation", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("peers") as batch:
        batch.drop_column("compute_utilisation")
        batch.drop_column("bytes_sent")
