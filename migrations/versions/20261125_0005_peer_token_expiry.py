"""Peer tokens expire: those issued before, which never did, get the default lifetime
(14 days, ``PEER_TOKEN_TTL_S``) from now; the next certificate renewal slides it on.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_PEER_TOKEN_TTL = timedelta(days=14)


def upgrade() -> None:
    tokens = sa.table(
        "tokens",
        sa.column("scope", sa.String),
        sa.column("expires_at", sa.DateTime(timezone=True)),
        sa.column("revoked_at", sa.DateTime(timezone=True)),
    )
    op.execute(
        tokens.update()
        .where(
            tokens.c.scope == "peer",
            tokens.c.expires_at.is_(None),
            tokens.c.revoked_at.is_(None),
        )
        .values(expires_at=datetime.now(UTC) + DEFAULT_PEER_TOKEN_TTL)
    )


def downgrade() -> None:
    pass  # an expiry is harmless to the earlier schema; which tokens had none is not kept
