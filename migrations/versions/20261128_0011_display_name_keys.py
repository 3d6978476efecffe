"""Display names compared as people read them: each volunteer's ``name_key`` (NFKC, case
folding, the UTS #39 confusable skeleton), indexed per run, filled in for every existing
volunteer. Names stored before invisible characters were refused keep their text; their key
is that of their visible form, so nobody can take a name that looks like theirs.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# Imported, not copied: the key must be the one the coordinator computes for new names, and
# it rests on the confusables data of the installed package; a change to it needs a new
# back-fill anyway.
from server.services.display_names import comparison_key

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 1000


def upgrade() -> None:
    with op.batch_alter_table("volunteers") as batch:
        batch.add_column(sa.Column("name_key", sa.String(length=32), nullable=True))
        batch.create_index("ix_volunteers_run_id_name_key", ["run_id", "name_key"])
    volunteers = sa.table(
        "volunteers",
        sa.column("id", sa.Integer()),
        sa.column("display_name", sa.String()),
        sa.column("name_key", sa.String()),
    )
    connection = op.get_bind()
    last = 0
    while True:
        rows = connection.execute(
            sa.select(volunteers.c.id, volunteers.c.display_name)
            .where(volunteers.c.id > last)
            .order_by(volunteers.c.id)
            .limit(BATCH)
        ).all()
        if not rows:
            return
        connection.execute(
            volunteers.update()
            .where(volunteers.c.id == sa.bindparam("volunteer_id"))
            .values(name_key=sa.bindparam("key")),
            [{"volunteer_id": i, "key": comparison_key(name)} for i, name in rows],
        )
        last = rows[-1][0]


def downgrade() -> None:
    with op.batch_alter_table("volunteers") as batch:
        batch.drop_index("ix_volunteers_run_id_name_key")
        batch.drop_column("name_key")
