"""Runs that start when the swarm is there and finish at their last epoch: a run's
``min_volunteers`` (held, paused, until that many volunteers are online) and
``finished_at_epoch`` (the epoch it finished at by itself).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 11:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("min_volunteers", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("finished_at_epoch", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("finished_at_epoch")
        batch.drop_column("min_volunteers")
